"""Speculation on a loopback cluster: a head and a tail of tiny random models of two families,
exact mode (float32) and the default mode (bfloat16, batch-invariant). The text with
speculation is the text without it, token for token: with drafts that hold (a repetitive
prompt), with drafts that never do, for seeded sampling, across a failover in mid-stream,
and for a next turn that starts from the KV the hops kept. The nodes' counters show that
drafts were really sent, kept and cut off."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from fabric.compute.models import resolve
from fabric.node import Node, NodeConfig
from fabric.node import speculation as spec_module
from fabric.node.speculation import SpeculationConfig
from fabric.wire.shard import Shard
from tests.support import wait_for
from tests.tiny_models import reference_greedy

TOKENS = 40
OFF = SpeculationConfig(enabled=False)
# repetitive prompts: their n-grams recur, and a random model's greedy text soon loops
PROMPTS = ["one two three four five six seven eight one two three four five six seven eight one two three",
           "a b c d a b c d a b c d a b c d a b c", "the fox the dog the fox the dog the fox the dog the"]


def split(cluster, model, dtype=torch.float32):
    head = cluster.add_node(model, 0, 2, 6, "head", dtype=dtype)
    tail = cluster.add_node(model, 3, 5, 6, "tail", dtype=dtype)
    cluster.wait_routable(model.name, 2)
    return head, tail


def speculate(head: Node, config: SpeculationConfig) -> None:
    """Requests this head starts from now on draft as ``config`` says."""
    head.head.config = dataclasses.replace(head.head.config, speculation=config)


def generate(cluster, model, prompt: str, max_tokens: int = TOKENS, **kw) -> list[int]:
    with cluster.client() as client:
        return [t for e in client.generate(model.name, prompt=prompt, max_tokens=max_tokens, **kw)
                for t in e.token_ids]


def prompt_ids(model, prompt: str) -> list[int]:
    from fabric.compute.models import load_tokenizer
    return list(load_tokenizer(resolve(str(model)))(prompt)["input_ids"])


def clear_prompts(model) -> list[str]:
    """The prompts whose float32 greedy reply leads clearly at every token (see reference_greedy)."""
    out = []
    for prompt in PROMPTS:
        try:
            reference_greedy(model, prompt_ids(model, prompt), TOKENS)
            out.append(prompt)
        except AssertionError:
            continue
    return out


def oracle(model, prompts: list[str], replies: list[list[int]], right=lambda at, i: (at + i) % 3):
    """A drafter that knows each prompt's reply and drafts it, wrong where ``right(place in the
    reply, place in the step)`` is false (by default every third place: drafts that hold, a
    rejection at every place in a step, and steps whose drafts all hold)."""
    starts = [prompt_ids(model, prompt) for prompt in prompts]

    def propose(self, history: list[int], k: int) -> list[int]:
        for start, reply in zip(starts, replies):
            if history[:len(start)] == start:
                at = len(history) - len(start)
                return [t if right(at, i) else (t + 1) % 320 for i, t in enumerate(reply[at:at + k])]
        return []
    return propose


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["exact", "default"])
def test_greedy_text_is_the_same_with_and_without_speculation(thread_cluster, tiny_models, family, dtype,
                                                              monkeypatch):
    model = tiny_models(family)
    head, tail = split(thread_cluster, model, dtype)
    prompts = PROMPTS if dtype == torch.bfloat16 else clear_prompts(model)
    assert prompts, "no prompt with a clear greedy lead: change PROMPTS"
    speculate(head, OFF)
    plain = [generate(thread_cluster, model, prompt) for prompt in prompts]
    if dtype == torch.float32:  # transformers' own greedy text
        assert plain == [reference_greedy(model, prompt_ids(model, prompt), TOKENS) for prompt in prompts]
    speculate(head, SpeculationConfig())
    assert [generate(thread_cluster, model, prompt) for prompt in prompts] == plain  # drafts by lookup
    trips, drafted = tail.counters["hops"], head.counters["spec_drafted"]
    monkeypatch.setattr(spec_module.Lookup, "propose", oracle(model, prompts, plain))
    speculate(head, SpeculationConfig(adaptive=False))
    assert [generate(thread_cluster, model, prompt) for prompt in prompts] == plain  # drafts that mostly hold
    c = head.counters  # counted once the DONE event has left: wait for the last request's
    assert wait_for(lambda: 0 < c["spec_kept"] < c["spec_drafted"] and c["spec_drafted"] >= drafted + 6, 5)
    assert tail.counters["rolled_back"] > 0 and head.counters["rolled_back"] > 0  # and cut off every hop
    assert tail.counters["hops"] - trips < sum(map(len, plain))  # fewer trips through the tail than tokens


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["exact", "default"])
def test_steps_sent_ahead_of_their_answer_keep_the_text(thread_cluster, tiny_models, family, dtype, monkeypatch):
    """Pipelined speculation: each step is followed, before its answer, by one that assumes its
    drafts all kept and guesses the token after them. With drafts that always hold, most steps
    sent ahead hold and the tail answers them; with a wrong draft at every third place, many are
    void, and the tail answers nothing for them, and every hop cuts their positions off. Either
    way the text is the text without drafts; without ``ahead`` no step is sent ahead."""
    model = tiny_models(family)
    head, tail = split(thread_cluster, model, dtype)
    prompts = PROMPTS if dtype == torch.bfloat16 else clear_prompts(model)
    speculate(head, OFF)
    plain = [generate(thread_cluster, model, prompt) for prompt in prompts]
    c = head.counters
    for right in (lambda at, i: True, lambda at, i: (at + i) % 3):
        monkeypatch.setattr(spec_module.Lookup, "propose", oracle(model, prompts, plain, right))
        speculate(head, SpeculationConfig(adaptive=False, max_drafts=3, first_drafts=3, ahead="on"))
        assert [generate(thread_cluster, model, prompt) for prompt in prompts] == plain
    assert wait_for(lambda: c["spec_ahead"] > c["spec_ahead_held"] > 0, 5)
    assert tail.counters["void_steps"] > 0 and tail.counters["rolled_back"] > 0 and head.counters["rolled_back"] > 0
    assert tail.counters["cache_miss"] == head.counters["cache_miss"] == 0  # every cut was in place
    assert wait_for(lambda: not head.head.sessions, 5)  # the last request's counts are in
    before = c["spec_ahead"], tail.counters["void_steps"]
    speculate(head, SpeculationConfig(adaptive=False, ahead="off"))
    assert [generate(thread_cluster, model, prompt) for prompt in prompts] == plain
    assert wait_for(lambda: c["spec_kept"] > 0, 5) and (c["spec_ahead"], tail.counters["void_steps"]) == before


def test_drafts_that_never_hold_change_nothing(thread_cluster, tiny_models, monkeypatch):
    model = tiny_models("llama")
    head, tail = split(thread_cluster, model, torch.bfloat16)
    speculate(head, OFF)
    plain = [generate(thread_cluster, model, prompt) for prompt in PROMPTS]
    never = lambda self, history, k: [319 - t for t in history[-k:]] if k > 0 else []  # noqa: E731
    monkeypatch.setattr(spec_module.Lookup, "propose", never)
    speculate(head, SpeculationConfig(adaptive=False))  # and drafting never pauses
    wrong = [generate(thread_cluster, model, prompt) for prompt in PROMPTS]
    assert wrong == plain
    assert wait_for(lambda: head.counters["spec_trips"] > 0, 5) and tail.counters["rolled_back"] > 0


def test_seeded_sampling_is_the_same_with_and_without_speculation(thread_cluster, tiny_models):
    """The tail samples each drafted position with the draw of (seed, position), as a one-token
    step would: a seeded request gives the same text either way (bit-equal logits: default mode)."""
    model = tiny_models("qwen3")
    head, _ = split(thread_cluster, model, torch.bfloat16)
    kw = dict(temperature=0.7, seed=1234)
    speculate(head, OFF)
    plain = [generate(thread_cluster, model, prompt, **kw) for prompt in PROMPTS]
    speculate(head, SpeculationConfig())
    assert [generate(thread_cluster, model, prompt, **kw) for prompt in PROMPTS] == plain
    assert wait_for(lambda: head.counters["spec_kept"] > 0, 5)


def stoppable(cluster, model, name: str) -> tuple[Node, threading.Event]:
    stop = threading.Event()
    node = Node(NodeConfig.build(resolve(str(model)), Shard(3, 5, 6), tracker=cluster.endpoint, node_id=name,
                                 progress=False, heartbeat_interval=cluster.heartbeat, audit_rate=0.0,
                                 dtype=torch.bfloat16))
    thread = threading.Thread(target=node.run, args=(stop,), daemon=True)
    thread.start()
    node.ready.wait(10)
    return node, stop


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_a_failover_in_mid_speculation_keeps_the_text(thread_cluster, tiny_models, monkeypatch, ahead):
    """The tail dies while the stream speculates (steps sent ahead of their answers or not):
    the head re-prefills the tokens it took (never a draft) on the other tail, and the text is
    the text without speculation or failover."""
    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head", dtype=torch.bfloat16)
    tails = {name: stoppable(thread_cluster, model, name) for name in ("tail1", "tail2")}
    thread_cluster.wait_routable(model.name, 3)
    speculate(head, OFF)
    prompt = PROMPTS[0]
    plain = generate(thread_cluster, model, prompt)
    monkeypatch.setattr(spec_module.Lookup, "propose", oracle(model, [prompt], [plain]))
    speculate(head, SpeculationConfig(adaptive=False, ahead=ahead))
    got, victim = [], None
    with thread_cluster.client() as client:
        for event in client.generate(model.name, prompt=prompt, max_tokens=TOKENS):
            victim = victim or event.route[-1].node
            got.extend(event.token_ids)
            if len(got) >= 8 and not tails[victim][1].is_set():
                assert head.head.sessions and next(iter(head.head.sessions.values())).speculation.trips > 0
                tails[victim][1].set()
    assert got == plain
    assert head.counters["failovers"] >= 1
    assert wait_for(lambda: not head.head.sessions, 5) and (head.counters["spec_ahead"] > 0) == (ahead == "on")
    for _, stop in tails.values():
        stop.set()


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_the_next_turn_reuses_only_what_was_kept(thread_cluster, tiny_models, monkeypatch, ahead):
    """A speculating request ends with rejected drafts on the hops: the next request that
    continues it starts from the kept KV cut back to the tokens taken, and its text is the
    text of a cold start."""
    from fabric.compute.models import load_tokenizer

    model = tiny_models("llama")
    head, tail = split(thread_cluster, model, torch.bfloat16)
    prompt, budget = PROMPTS[0], tail.kv.retained.budget
    tail.kv.retained.budget = head.kv.retained.budget = 0  # nothing kept: cold starts for the control
    speculate(head, OFF)
    first = generate(thread_cluster, model, prompt)
    tok = load_tokenizer(resolve(str(model)))
    stop = tok.decode(first[20:22], skip_special_tokens=True)  # it ends in mid-step, after a draft kept
    first = generate(thread_cluster, model, prompt, stop=stop)
    monkeypatch.setattr(spec_module.Lookup, "propose", oracle(model, [prompt], [first], right=lambda at, i: i == 0))
    speculate(head, SpeculationConfig(adaptive=False, first_drafts=4, ahead=ahead))
    assert generate(thread_cluster, model, prompt, stop=stop) == first
    assert wait_for(lambda: head.counters["spec_kept"] > 0, 5)
    assert wait_for(lambda: not head.head.sessions, 5) and (head.counters["spec_ahead"] > 0) == (ahead == "on")
    follow = prompt + tok.decode(first, skip_special_tokens=True) + " and"
    cold = generate(thread_cluster, model, follow, max_tokens=24)
    assert wait_for(lambda: len(head.kv) == len(tail.kv) == 0, 5)  # every CLOSE so far has ended its session
    tail.kv.retained.budget = head.kv.retained.budget = budget
    generate(thread_cluster, model, prompt, stop=stop)  # kept, rejected drafts and all
    assert wait_for(lambda: len(tail.kv.retained) == 1, 5)
    kept = [kv.retained.peek(kv.retained.sessions()[0]) for kv in (head.kv, tail.kv)]
    held = len(prompt_ids(model, prompt)) + len(first) - 1  # every token but the last was fed
    assert all(kv.drafted > 0 and kv.length > held for kv in kept)  # its last step's rejected drafts are there
    assert generate(thread_cluster, model, follow, max_tokens=24) == cold
    assert tail.kv.retained.stats["hits"] == 1 and head.kv.retained.stats["hits"] == 1


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_audits_of_speculating_requests_convict_nobody(thread_cluster, tiny_models, monkeypatch, ahead):
    """Every request audited while its head drafts (rejections at every place in a step), with
    steps sent ahead of their answers or not: the taps of the tail cover only the positions kept
    (none of a step sent ahead that did not hold), so the replicas' replays agree with every
    hop, and the text is the text without drafts."""
    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head", audit_rate=1.0)
    for name in ("tail1", "tail2", "tail3"):
        thread_cluster.add_node(model, 3, 5, 6, name)
    thread_cluster.wait_routable(model.name, 4)
    prompts = PROMPTS[:2]
    speculate(head, OFF)
    plain = [generate(thread_cluster, model, prompt) for prompt in prompts]
    right = lambda at, i: (at + i) % 7 != 3  # noqa: E731 (wrong at every 7th token: steps that hold, some not)
    monkeypatch.setattr(spec_module.Lookup, "propose", oracle(model, prompts, plain, right))
    speculate(head, SpeculationConfig(adaptive=False, max_drafts=3, ahead=ahead))
    audits = head.counters["audits"]
    assert [generate(thread_cluster, model, prompt) for prompt in prompts] == plain
    c = head.counters
    assert wait_for(lambda: c["spec_kept"] > 0 and c["audits_passed"] + c["audits_unsettled"] + c["audits_skipped"]
                    >= c["audits"] >= audits + 2, 30)
    assert c["audits_convicted"] == 0 and c["audits_unsettled"] == 0 and c["audits_passed"] >= audits + 2
    assert (c["spec_ahead"] > c["spec_ahead_held"] > 0 and c["spec_kept"] < c["spec_drafted"]) == (ahead == "on")


def test_a_request_can_turn_speculation_off(thread_cluster, tiny_models):
    """``speculation: false`` in the HTTP body (and ``speculation=False`` on the Client) reaches
    the head as GENERATE.speculation: the head drafts nothing for that request, though it drafts
    for every other (``adaptive`` off: whatever happens), and the text is the same. A value that
    is not a boolean is a 400 naming the field, before anything reaches the fabric."""
    import asyncio

    from fabric import AsyncClient
    from webui import WebUIConfig, create_app

    model = tiny_models("llama")
    head, _ = split(thread_cluster, model, torch.bfloat16)
    speculate(head, SpeculationConfig(adaptive=False))
    c = head.counters
    body = {"model": model.name, "prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}

    async def ask(extra: dict) -> tuple[int, dict]:
        async with AsyncClient(thread_cluster.endpoint, timeout=30) as fabric:
            client = create_app(WebUIConfig(tracker=thread_cluster.endpoint), fabric).test_client()
            response = await client.post("/v1/completions", json={**body, **extra})
            return response.status_code, await response.get_json()

    status, off = asyncio.run(ask({"speculation": False}))
    assert status == 200
    assert generate(thread_cluster, model, PROMPTS[0], ignore_eos=True, speculation=False)
    assert wait_for(lambda: not head.head.sessions, 5)  # both ended, and so counted
    assert c["spec_trips"] == c["spec_drafted"] == 0  # two requests, no draft
    status, on = asyncio.run(ask({}))
    assert status == 200 and on["choices"][0]["text"] == off["choices"][0]["text"]
    assert wait_for(lambda: c["spec_drafted"] > 0, 5)  # the control: the same request, drafting
    for wrong in ("no", 0, [False]):  # (null, as for every field, means the default)
        status, error = asyncio.run(ask({"speculation": wrong}))
        assert status == 400 and error["error"]["param"] == "speculation", error
