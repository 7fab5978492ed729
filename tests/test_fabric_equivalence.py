"""Greedy output of a model split across nodes equals one transformers process, token for token.

Nodes run in threads of the test process but talk over real loopback ZeroMQ sockets, and
routes come from a real tracker.
"""
from __future__ import annotations

import threading

import pytest

from fabric.compute.models import load_tokenizer, resolve
from fabric.wire.protocol import Hop
from fabric.wire.shard import even_split
from tests.support import wait_for
from tests.tiny_models import FAMILIES, reference_greedy

MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]
NEW_TOKENS = 24


def prompt_ids(model_dir) -> list[int]:
    tok = load_tokenizer(resolve(str(model_dir)))
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


def generated_ids(client, model, **kw) -> list[int]:
    events = list(client.generate(model, messages=MESSAGES, max_tokens=NEW_TOKENS, **kw))
    assert events[-1].event == "done" and events[-1].finish_reason == "length"
    return [t for e in events if e.event == "token" for t in e.token_ids]


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_equals_single_process(thread_cluster, tiny_models, family, parts):
    model_dir = tiny_models(family)
    expected = reference_greedy(model_dir, prompt_ids(model_dir), NEW_TOKENS)
    assert len(set(expected)) > 3, "the reference must not be a degenerate repetition"
    for i, shard in enumerate(even_split(6, parts)):
        thread_cluster.add_node(model_dir, shard.start, shard.end, 6, f"n{i}")
    status = thread_cluster.wait_routable(model_dir.name, parts)
    hops = status["plans"][model_dir.name][0]["hops"]
    assert [(h["start_layer"], h["end_layer"]) for h in hops][0][0] == 0
    with thread_cluster.client() as client:
        assert generated_ids(client, model_dir.name) == expected


def test_partial_head_then_full_node_starts_after_head(thread_cluster, tiny_models):
    """A partial head 0-2 and a full node 0-5: the full node runs 3-5, from the head's end + 1."""
    model_dir = tiny_models("llama")
    expected = reference_greedy(model_dir, prompt_ids(model_dir), NEW_TOKENS)
    head = thread_cluster.add_node(model_dir, 0, 2, 6, "head")
    full = thread_cluster.add_node(model_dir, 0, 5, 6, "full")
    status = thread_cluster.wait_routable(model_dir.name, 2)
    for plan in status["plans"][model_dir.name]:
        hops = plan["hops"]
        for prev, nxt in zip(hops, hops[1:]):
            assert nxt["start_layer"] == prev["end_layer"] + 1
    route = (Hop("head", head.endpoint, 0, 2), Hop("full", full.endpoint, 3, 5))
    with thread_cluster.client() as client:
        assert generated_ids(client, model_dir.name, route=route) == expected
        assert generated_ids(client, model_dir.name, route=(Hop("full", full.endpoint, 0, 5),)) == expected


def test_cache_miss_reprefills_and_output_is_unchanged(thread_cluster, tiny_models):
    """The tail loses the session's KV mid-generation: it answers CACHE_MISS, the head
    re-prefills the whole history, and the tokens are the same."""
    model_dir = tiny_models("qwen3")
    expected = reference_greedy(model_dir, prompt_ids(model_dir), NEW_TOKENS)
    head = thread_cluster.add_node(model_dir, 0, 2, 6, "head")
    tail = thread_cluster.add_node(model_dir, 3, 5, 6, "tail")
    route = (Hop("head", head.endpoint, 0, 2), Hop("tail", tail.endpoint, 3, 5))
    evicted = threading.Event()
    ids = []
    with thread_cluster.client() as client:
        for event in client.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS, route=route):
            ids.extend(event.token_ids)
            if len(ids) == 5 and not evicted.is_set():
                for session in tail.kv.sessions():  # evict, as an idle timeout or restart would
                    tail.kv.drop(session)
                evicted.set()
    assert evicted.is_set()
    assert tail.counters["cache_miss"] >= 1
    assert ids == expected
    assert wait_for(lambda: not head.head.sessions, 5)  # the request ended and left no session on the head
