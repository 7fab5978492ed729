"""Chunked prefill: a node runs a long prompt in slices that take turns with decode batches,
passes each on as a chunk, and every stream still gets exactly the single-process tokens."""
from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fabric import protocol as p
from fabric.client import wait_for
from fabric.node import GATHER_PER_DECODE, MIN_SLICE_TOKENS, WHOLE_PREFILL_TOKENS, Node, Work
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


def slicer(queue: list[Work], kv_sessions: list[str], busy: float = 32, idle: float = 32,
           decode_s: float | None = None, prefill_slice: float = 0.0):
    node = SimpleNamespace(work=deque(queue), kv={s: None for s in kv_sessions}, _decode_batch_s=decode_s,
                           _slice_tokens={"busy": float(busy), "idle": float(idle)},
                           config=SimpleNamespace(prefill_slice=prefill_slice), _decode_step=Node._decode_step)
    node._slice_mode = lambda session: Node._slice_mode(node, session)
    return node


def test_a_long_prefill_is_cut_and_the_rest_queued_first():
    node = slicer([work("a", 40, 1)], ["a"], busy=25, idle=500)  # "a" decodes here: busy
    first = Node._slice(node, work("long", 0, 100))
    assert first.tensor.shape[1] == 25 and first.msg.pos == 0 and first.msg.more
    rest = node.work[0]
    assert rest.msg.session == "long" and rest.msg.pos == 25 and rest.tensor.shape[1] == 75 and not rest.msg.more
    assert torch.equal(torch.cat([first.tensor, rest.tensor], 1), torch.zeros((1, 100), dtype=torch.int64))


def test_alone_a_prefill_uses_the_idle_size_and_short_ones_go_whole():
    node = slicer([], [], busy=8, idle=125)
    assert Node._slice(node, work("long", 0, 1000)).tensor.shape[1] == 125
    short = slicer([], [], busy=8, idle=125)
    assert Node._slice(short, work("short", 0, 100)).msg.more is False and not short.work


def test_the_last_slice_keeps_the_chunk_flag_it_came_with():
    node = slicer([], ["x"], busy=5)
    first = Node._slice(node, work("long", 10, 70, more=True))
    assert (first.tensor.shape[1], first.msg.more) == (5, True)
    assert (node.work[0].msg.pos, node.work[0].msg.more) == (15, True)


def test_a_prompt_under_two_slices_or_a_short_one_goes_whole():
    # cut, its rest (or every piece) would be too small to pay for reading the weights once more
    node = slicer([work("a", 40, 1)], ["a"], busy=40)
    whole = Node._slice(node, work("short", 0, 79))
    assert whole.tensor.shape[1] == 79 and not whole.msg.more and len(node.work) == 1
    small = slicer([work("a", 40, 1)], ["a"], busy=8)
    assert Node._slice(small, work("short", 0, WHOLE_PREFILL_TOKENS - 1)).tensor.shape[1] == WHOLE_PREFILL_TOKENS - 1
    assert Node._slice(small, work("long", 0, WHOLE_PREFILL_TOKENS)).tensor.shape[1] == 8


def test_slices_are_steered_toward_one_decode_step_beside_streams():
    node = slicer([], ["a"], busy=80, decode_s=0.05)
    Node._steer_slices(node, work("long", 0, 80), elapsed=0.2)  # 4x too long: halve (at most 2x a step)
    assert node._slice_tokens["busy"] == 40
    Node._steer_slices(node, work("long", 40, 40), elapsed=0.04)  # a bit short: grow in proportion
    assert node._slice_tokens["busy"] == 50
    Node._steer_slices(node, work("long", 80, 7), elapsed=0.5)  # a remainder: no information
    assert node._slice_tokens["busy"] == 50
    node._slice_tokens["busy"] = MIN_SLICE_TOKENS + 1
    Node._steer_slices(node, work("long", 80, MIN_SLICE_TOKENS + 1), elapsed=5.0)  # never below the minimum
    assert node._slice_tokens["busy"] == MIN_SLICE_TOKENS
    alone = slicer([], [], idle=40)
    Node._steer_slices(alone, work("long", 0, 40), elapsed=0.01)  # alone the target is IDLE_SLICE_S
    assert alone._slice_tokens["idle"] == 80


def test_long_prompt_chunked_beside_running_streams(thread_cluster, tiny_models):
    model = tiny_models("llama")
    # slices of the minimum (8 tokens) once timed: the long prompt (over 64 tokens) goes in chunks
    head = thread_cluster.add_node(model, 0, 2, 6, "head", prefill_slice=1e-9)
    tail = thread_cluster.add_node(model, 3, 5, 6, "tail", prefill_slice=1e-9)
    thread_cluster.wait_routable(model.name, 2)
    prompts = ["hi", "one two", "a much longer prompt that arrives while the others decode, " * 12]
    outputs = thread_cluster.stream_all(model.name, prompts, 24)
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


def test_short_prompts_queued_together_run_as_one_batch():
    queue = [work("a", 0, 30), work("x", 40, 1), work("b", 0, 20), work("long", 0, 500), work("c", 0, 40),
             work("d", 0, 200)]
    node = slicer(queue, ["x"], busy=8)
    ran = []
    node.executor = SimpleNamespace(batchable=lambda start, end: True)
    node.config.max_batch = 16
    node._ran_prefill = False
    node._execute = ran.append
    node._take, node._slice = Node._take.__get__(node), Node._slice.__get__(node)
    node._short_prompt = Node._short_prompt
    Node._run_next(node)
    # "d" would take the batch past PREFILL_BATCH_TOKENS; the long prompt runs alone, in slices
    assert [w.msg.session for w in ran[0]] == ["a", "b", "c"]
    assert [w.msg.session for w in node.work] == ["x", "long", "d"]


def gatherer(queue: list[Work], last_decode: dict[str, float], batch_s: float = 0.04, cycle_s: float = 0.1,
             locked: bool = False, ran_prefill: bool = False):
    return SimpleNamespace(work=deque(queue), kv={s: None for s in last_decode}, _last_decode=dict(last_decode),
                           _cycle_s=cycle_s, _decode_batch_s=batch_s, _gather_since=None, _ran_prefill=ran_prefill,
                           _compute_lock=SimpleNamespace(shared=locked), config=SimpleNamespace(max_batch=16),
                           _decode_step=Node._decode_step)


def test_a_decode_batch_waits_a_little_for_sessions_due_here():
    node = gatherer([work("a", 40, 1)], {"a": 9.9, "b": 9.95})
    assert Node._gather_wait(node, 10.0) == pytest.approx(GATHER_PER_DECODE * 0.04)  # "b" decoded here just now
    assert 0 < Node._gather_wait(node, 10.01) < GATHER_PER_DECODE * 0.04  # the same wait, not a new one
    node.work.append(work("b", 50, 1))
    assert Node._gather_wait(node, 10.011) == 0  # everyone due is here: run
    late = gatherer([work("a", 40, 1)], {"a": 9.9, "b": 9.95})
    Node._gather_wait(late, 10.0)
    assert Node._gather_wait(late, 10.0 + GATHER_PER_DECODE * 0.04) == 0  # waited long enough: run without "b"


def test_nothing_waits_for_sessions_gone_quiet_or_beside_a_prefill():
    stale = gatherer([work("a", 40, 1)], {"a": 9.9, "b": 9.0})  # "b" last decoded 10 cycles ago
    assert Node._gather_wait(stale, 10.0) == 0
    freed = gatherer([work("a", 40, 1)], {"a": 9.9, "b": 9.95})
    del freed.kv["b"]  # closed: its KV is gone
    assert Node._gather_wait(freed, 10.0) == 0
    prefill = gatherer([work("a", 40, 1), work("new", 0, 30)], {"a": 9.9, "b": 9.95})
    assert Node._gather_wait(prefill, 10.0) == 0  # a prefill runs in the meantime instead


def test_under_a_compute_lock_a_slice_waits_for_the_streams_to_come_back():
    # another slice now would hold the machine while the other node has their decode steps
    node = gatherer([work("long", 64, 500), work("a", 40, 1)], {"a": 9.9, "b": 9.95}, locked=True, ran_prefill=True)
    assert Node._gather_wait(node, 10.0) == pytest.approx(0.1)  # up to one cycle of theirs
    assert Node._gather_wait(node, 10.1) == 0
    node.work.append(work("b", 50, 1))
    assert Node._gather_wait(node, 10.0) == 0  # the whole group is back: its decode batch goes first
    unlocked = gatherer([work("long", 64, 500)], {"a": 9.9}, ran_prefill=True)
    assert Node._gather_wait(unlocked, 10.0) == 0  # its own machine: the slice fills the gap


def test_the_compute_lock_lets_one_process_compute_at_a_time_and_dies_with_its_holder(tmp_path):
    import subprocess
    import sys

    from fabric.compute_lock import ComputeLock

    path = str(tmp_path / "compute.lock")
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from fabric.compute_lock import ComputeLock
with ComputeLock({path!r}):
    print("held", flush=True)
    time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = ComputeLock(path)
        waiter = threading.Thread(target=lambda: lock.__enter__())
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # the other process holds it
        holder.kill()  # kill -9 of the holder frees it
        waiter.join(10)
        assert not waiter.is_alive()
        lock.__exit__(None, None, None)
        lock.close()
    finally:
        holder.kill()
        holder.wait()
    with ComputeLock(None):  # no file: nothing to share, nothing happens
        pass
