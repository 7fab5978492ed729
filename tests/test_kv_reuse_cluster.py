"""KV reuse on a loopback cluster: a chat's next turn, a shared system prompt, concurrent
streams, a cancelled request and a failover. Every reply is transformers' greedy reply with
no reuse (float32, see tests/tiny_models.py); the nodes' hit counters and the tracker's
status show that the reuse really happened."""
from __future__ import annotations

import threading

import pytest

from fabric.cli.status_view import format_status
from fabric.compute.models import load_tokenizer, resolve
from fabric.node import Node, NodeConfig
from fabric.node.prefixes import common_prefix
from fabric.wire.shard import Shard
from tests.support import at_once, wait_for
from tests.tiny_models import reference_greedy

SYSTEM = "meshnet splits a model across nodes, the quick brown fox jumps over the lazy dog. " * 2
USERS = ["hello world", "how are you today?", "the lazy dog", "meshnet splits a model", "quick brown fox",
         "hello there, fox", "jumps over the dog", "a model across nodes", "how are you, world?", "today"]
TOKENS = 12


def chat_ids(model, messages: list[dict]) -> list[int]:
    tok = load_tokenizer(resolve(str(model)))
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def turn(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def ask(cluster, model, messages: list[dict], max_tokens: int = TOKENS, cancel_after: int = 0):
    """Greedy token ids and text of one request (closed after ``cancel_after`` tokens: cancelled)."""
    ids, text = [], ""
    with cluster.client() as client:
        for event in client.generate(model.name, messages=messages, max_tokens=max_tokens):
            ids.extend(event.token_ids)
            text += event.text
            if cancel_after and len(ids) >= cancel_after:
                break
    return ids, text


def kept(*nodes) -> list[dict]:
    return [dict(n.kv.retained.stats) for n in nodes]


def split(cluster, model, **kw):
    head = cluster.add_node(model, 0, 2, 6, "head", **kw)
    tail = cluster.add_node(model, 3, 5, 6, "tail", **kw)
    cluster.wait_routable(model.name, 2)
    return head, tail


def next_turn(model):
    """A first turn whose reply, as text in the next turn's chat, gives back the reply's own
    token ids (a random model's bytes rarely do), so that turn 2 continues all that turn 1
    left in the KV: its prompt, and its reply but the last token, never fed back. Returns
    (turn 1 messages, its max_tokens, its reply ids)."""
    tok = load_tokenizer(resolve(str(model)))
    for user in USERS:
        first = turn(SYSTEM, user)
        ids = chat_ids(model, first)
        try:
            reply = reference_greedy(model, ids, TOKENS)
        except AssertionError:  # a greedy token without a clear lead: another prompt
            continue
        for k in range(len(reply) - 1, 1, -1):
            text = tok.decode(reply[:k + 1], skip_special_tokens=True)
            again = chat_ids(model, first + [{"role": "assistant", "content": text}, {"role": "user", "content": "ok"}])
            if again[:len(ids) + k] == ids + reply[:k] and reply[k] not in (2,):
                return first, k + 1, reply[:k + 1]
    pytest.fail("no first turn whose reply survives as text: change USERS")


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_turn_two_continues_all_of_turn_one(thread_cluster, tiny_models, reuse):
    model = tiny_models("llama")
    first, max_tokens, reply = next_turn(model)
    head, tail = split(thread_cluster, model, **({} if reuse else {"kv_cache_bytes": 0}))
    got, text = ask(thread_cluster, model, first, max_tokens)
    assert got == reply
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "and the fox?"}]
    ids = chat_ids(model, second)
    held = chat_ids(model, first) + reply[:-1]
    assert ids[:len(held)] == held  # the whole of turn 1's KV is a start of turn 2
    got, _ = ask(thread_cluster, model, second)
    assert got == reference_greedy(model, ids, TOKENS)
    if not reuse:
        assert kept(head, tail) == [{"hits": 0, "misses": 0, "reused_tokens": 0, "evictions": 0}] * 2
        assert head.kv.retained.bytes == 0
        return
    assert [(s["hits"], s["misses"], s["reused_tokens"]) for s in kept(head, tail)] == [(1, 0, len(held))] * 2
    # turn 1's KV moved into turn 2, which the hops keep now
    assert head.kv.retained.sessions() == tail.kv.retained.sessions() and len(head.kv.retained) == 1
    assert len(head.kv) == len(tail.kv) == 0 and head.kv.retained.bytes > 0
    metrics = {s.name: s.value for s in tail.metrics()}
    assert metrics["node_kv_reuse_hits_total"] == 1 and metrics["node_kv_kept_bytes"] == tail.kv.retained.bytes

    def shown():  # the next heartbeats carry the counters to the tracker
        rows = {n["id"]: n["kv_cache"] for n in status(thread_cluster)["nodes"]}
        return rows["tail"]["hits"] == 1 and rows["tail"]["bytes"] > 0
    assert wait_for(shown, 5)
    assert "(1/0)" in format_status(status(thread_cluster))


def status(cluster) -> dict:
    with cluster.client() as client:
        return client.status()


def test_a_shared_system_prompt_is_computed_once_and_a_long_rest_in_chunks(thread_cluster, tiny_models):
    """Two chats share a system prompt, then differ: the second starts from what matches
    and computes the rest, a long user message, in slices passed on as chunks."""
    model = tiny_models("qwen3")
    head, tail = split(thread_cluster, model)
    a, b = turn(SYSTEM, "hello world"), turn(SYSTEM, "how are you today? the lazy dog. " * 8)
    ask(thread_cluster, model, a)
    ids_a, ids_b = chat_ids(model, a), chat_ids(model, b)
    shared = common_prefix(tuple(ids_a), tuple(ids_b))
    system = load_tokenizer(resolve(str(model))).apply_chat_template(
        [{"role": "system", "content": SYSTEM}], tokenize=True, return_dict=False)
    assert shared >= len(system) and len(ids_b) - shared > 64  # all of the system prompt; a long rest
    head.scheduler.slice_tokens = {"busy": 16.0, "idle": 16.0}  # slices of 16 tokens from here (they grow)
    chunks = tail.counters["prefill_chunks"]
    got, _ = ask(thread_cluster, model, b)
    assert got == reference_greedy(model, ids_b, TOKENS)
    assert [(s["hits"], s["reused_tokens"]) for s in kept(head, tail)] == [(1, shared)] * 2
    assert tail.counters["prefill_chunks"] > chunks
    assert len(head.kv.retained) == 2  # a partial match copies: chat a's KV stays for its next turn


def test_concurrent_chats_each_continue_their_own_turn(thread_cluster, tiny_models):
    model = tiny_models("llama")
    head, tail = split(thread_cluster, model)
    firsts = [turn(SYSTEM, user) for user in USERS[:4]]
    replies = run_together(thread_cluster, model, firsts)
    seconds = [m + [{"role": "assistant", "content": replies[i][1]}, {"role": "user", "content": "go on"}]
               for i, m in enumerate(firsts)]
    batched = head.counters["batched_hops"] + tail.counters["batched_hops"]
    outputs = run_together(thread_cluster, model, seconds)
    for i, messages in enumerate(seconds):
        assert outputs[i][0] == reference_greedy(model, chat_ids(model, messages), TOKENS), i
    assert all(s["hits"] == 4 and s["misses"] == 0 for s in kept(head, tail))
    assert head.counters["batched_hops"] + tail.counters["batched_hops"] > batched  # and they decoded together


def run_together(cluster, model, chats: list[list[dict]]) -> dict[int, tuple[list[int], str]]:
    return at_once(lambda i: ask(cluster, model, chats[i]), len(chats))


def test_a_cancelled_reply_is_continued_from_what_the_hops_hold(thread_cluster, tiny_models):
    """A reply cancelled mid-stream: the hops keep what they computed (maybe a step more than
    the head heard of), and the next turn starts from the part the head knows they hold.
    A request cancelled before its first token leaves nothing to offer."""
    model = tiny_models("llama")
    head, tail = split(thread_cluster, model)
    first = turn(SYSTEM, "hello world")
    got, text = ask(thread_cluster, model, first, max_tokens=40, cancel_after=4)
    assert len(got) >= 4
    assert wait_for(lambda: len(head.kv) == len(tail.kv) == 0 and len(tail.kv.retained) == 1, 5)
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    ids = chat_ids(model, second)
    got, _ = ask(thread_cluster, model, second)
    assert got == reference_greedy(model, ids, TOKENS)
    assert [s["hits"] for s in kept(head, tail)] == [1, 1]
    ask(thread_cluster, model, turn(SYSTEM, "the lazy dog"), cancel_after=1)
    third = turn(SYSTEM, "the lazy dog")
    got, _ = ask(thread_cluster, model, third)
    assert got == reference_greedy(model, chat_ids(model, third), TOKENS)
    assert all(s["misses"] == 0 for s in kept(head, tail))


def test_after_a_failover_the_next_turn_reuses_the_hops_that_finished_it(thread_cluster, tiny_models):
    """A tail dies mid-reply; the head re-prefills on the other tail and finishes there. The
    next turn reuses what the head and that tail hold, never the dead tail's."""
    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head")
    tails = {name: stoppable(thread_cluster, model, name) for name in ("tail1", "tail2")}
    try:
        thread_cluster.wait_routable(model.name, 3)
        first = turn(SYSTEM, "hello world")
        got, text, victim = [], "", None
        with thread_cluster.client() as client:
            for event in client.generate(model.name, messages=first, max_tokens=TOKENS):
                victim = victim or event.route[-1].node
                got.extend(event.token_ids)
                text += event.text
                if len(got) == 3:
                    tails[victim][1].set()  # the tail's loop ends and its sockets close
        assert got == reference_greedy(model, chat_ids(model, first), TOKENS)
        assert head.counters["failovers"] >= 1
        survivor = tails["tail2" if victim == "tail1" else "tail1"][0]
        assert wait_for(lambda: len(status(thread_cluster)["nodes"]) == 2, 10)  # the dead tail expired
        second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
        got, _ = ask(thread_cluster, model, second)
        assert got == reference_greedy(model, chat_ids(model, second), TOKENS)
        assert kept(head)[0]["hits"] == 1 and kept(survivor)[0]["hits"] == 1
        assert kept(head)[0]["misses"] == kept(survivor)[0]["misses"] == 0
    finally:
        for _, stop in tails.values():
            stop.set()


def stoppable(cluster, model, node_id: str) -> tuple[Node, threading.Event]:
    """A tail node of ``cluster`` with its own stop event (setting it is the node's death)."""
    config = NodeConfig.build(resolve(str(model)), Shard(3, 5, 6), tracker=cluster.endpoint, node_id=node_id,
                              progress=False, heartbeat_interval=cluster.heartbeat)
    node, stop = Node(config), threading.Event()
    thread = threading.Thread(target=node.run, args=(stop,), daemon=True)
    thread.start()
    cluster.threads.append(thread)
    node.ready.wait(10)
    return node, stop
