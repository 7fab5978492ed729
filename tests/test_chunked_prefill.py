"""Chunked prefill: a long prompt goes in chunks that take turns with decode batches, and
every stream still gets exactly the single-process tokens."""
from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from fabric import protocol as p
from fabric.client import wait_for
from fabric.node import Node, Work
from tests.test_batching import prompt_ids_for
from tests.tiny_models import reference_greedy


def work(session: str, pos: int, q: int, more: bool = False) -> Work:
    msg = p.Forward(session=session, step=0, pos=pos, start_layer=0, end_layer=1, route=(), reply_to="x",
                    more=more)
    return Work(msg, torch.zeros((1, q), dtype=torch.int64))


def take_all(queue: list[Work]) -> list[tuple[str, int]]:
    """The order a node runs ``queue`` in, one hop at a time (as if nothing batched)."""
    node = SimpleNamespace(work=deque(queue), _ran_prefill=False, _decode_step=Node._decode_step)
    order = []
    while node.work:
        w = Node._take(node, decode=node._ran_prefill)
        node._ran_prefill = not Node._decode_step(w)
        order.append((w.msg.session, w.msg.pos))
    return order


def test_prefill_chunks_and_decode_steps_take_turns():
    queue = [work("long", 0, 8, more=True), work("long", 8, 8, more=True), work("long", 16, 8),
             work("a", 40, 1), work("b", 50, 1)]
    # a chunk, then a decode step, a chunk, a decode step: neither kind waits for the other to drain
    assert take_all(queue) == [("long", 0), ("a", 40), ("long", 8), ("b", 50), ("long", 16)]


def test_a_sessions_hops_never_overtake_each_other():
    # a stale decode step of "s" queued before its re-prefill: it must still run first
    queue = [work("s", 30, 1), work("s", 0, 4, more=True), work("s", 4, 4), work("t", 9, 1)]
    order = take_all([work("x", 0, 4)] + queue)  # after a prefill, decode steps are preferred
    assert [o for o in order if o[0] == "s"] == [("s", 30), ("s", 0), ("s", 4)]


@pytest.mark.parametrize("chunk", [1, 3])  # 1: every chunk looks like a decode step (q = 1) yet is not one
def test_long_prompt_chunked_beside_running_streams(thread_cluster, tiny_models, chunk):
    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head", prefill_chunk=chunk)
    tail = thread_cluster.add_node(model, 3, 5, 6, "tail", prefill_chunk=chunk)
    thread_cluster.wait_routable(model.name, 2)
    prompts = ["hi", "one two", "a much longer prompt that arrives while the others decode, " * 3]
    outputs: dict[int, list[int]] = {}
    started = threading.Barrier(len(prompts))

    def stream(i: int) -> None:
        with thread_cluster.client() as client:
            started.wait(30)
            events = client.generate(model.name, messages=[{"role": "user", "content": prompts[i]}], max_tokens=24)
            outputs[i] = [t for e in events for t in e.token_ids]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        assert outputs[i] == reference_greedy(model, prompt_ids_for(model, prompt), 24), prompt
    # with other requests in flight, prompts went in chunks through both hops
    assert head.counters["prefill_chunks"] > 0 and tail.counters["prefill_chunks"] > 0
    assert wait_for(lambda: len(head.kv) == len(tail.kv) == 0, 5)  # every chunk's KV was freed with its session


def test_bfloat16_wire_for_a_float32_route(thread_cluster, tiny_models):
    """--wire-dtype bfloat16: hidden states cross the wire rounded to bfloat16 (half the
    bytes); the tokens are those of a split run that rounds at the same place."""
    from fabric.executor import ShardExecutor
    from fabric.kv import KVStore
    from fabric.models import load_shard, resolve
    from fabric.shard import Shard

    model = tiny_models("llama")
    thread_cluster.add_node(model, 0, 2, 6, "head", wire_dtype="bfloat16")
    tail = thread_cluster.add_node(model, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model.name, 2)
    seen: list[torch.dtype] = []
    run = tail.executor.run
    tail.executor.run = lambda session, start, end, inputs, pos, **kw: (seen.append(inputs.dtype),
                                                                         run(session, start, end, inputs, pos, **kw))[1]
    with thread_cluster.client() as client:
        events = client.generate(model.name, messages=[{"role": "user", "content": "hello there"}], max_tokens=16)
        got = [t for e in events for t in e.token_ids]

    source = resolve(str(model))
    a = ShardExecutor(load_shard(source, Shard(0, 2, 6), progress=False), KVStore())
    b = ShardExecutor(load_shard(source, Shard(3, 5, 6), progress=False), KVStore())
    ids, pos, expected = prompt_ids_for(model, "hello there"), 0, []
    x = torch.tensor([ids])
    while len(expected) < 16:
        hidden = a.run("s", 0, 2, x, pos).hidden.to(torch.bfloat16)
        token = int(b.run("s", 3, 5, hidden, pos).logits.argmax())
        pos += x.shape[1]
        expected.append(token)
        x = torch.tensor([[token]])
    assert seen and set(seen) == {torch.bfloat16}
    assert got == expected[:len(got)] and len(got) >= 8
