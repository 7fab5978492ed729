"""Chunked prefill: a node runs a long prompt in slices that ride in the decode batches'
passes, passes each on as a chunk, and every stream still gets exactly the single-process tokens.
How the slices are cut and ordered is tested on the scheduler alone (tests/test_scheduler.py)."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from tests.support import at_once, wait_for
from tests.test_batching import prompt_ids_for
from tests.tiny_models import reference_greedy


def test_long_prompt_chunked_beside_running_streams(thread_cluster, tiny_models):
    model = tiny_models("llama")
    # slices of the minimum (8 tokens) once timed: the long prompt (over 64 tokens) goes in chunks
    head = thread_cluster.add_node(model, 0, 2, 6, "head", prefill_slice=1e-9)
    tail = thread_cluster.add_node(model, 3, 5, 6, "tail", prefill_slice=1e-9)
    thread_cluster.wait_routable(model.name, 2)
    prompts = ["hi", "one two", "a much longer prompt that arrives while the others decode, " * 12]
    tokens = [48, 48, 24]  # the short ones still decode while the long one is prefilled
    decoding = threading.Barrier(len(prompts))

    def stream(i: int) -> list[int]:
        if i == len(prompts) - 1:
            decoding.wait(30)  # the long prompt arrives once the others decode
        out = []
        with thread_cluster.client() as client:
            for event in client.generate(model.name, messages=[{"role": "user", "content": prompts[i]}],
                                         max_tokens=tokens[i]):
                out += event.token_ids
                if len(out) == 2 and i < len(prompts) - 1:
                    decoding.wait(30)
        return out

    outputs = at_once(stream, len(prompts))
    for i, prompt in enumerate(prompts):
        assert outputs[i] == reference_greedy(model, prompt_ids_for(model, prompt), tokens[i]), prompt
    # the long prompt went in chunks through both hops, riding in the streams' decode passes
    assert head.counters["prefill_chunks"] > 0 and tail.counters["prefill_chunks"] > 0
    assert head.counters["riding_chunks"] > 0 and tail.counters["riding_chunks"] > 0
    assert wait_for(lambda: len(head.kv) == len(tail.kv) == 0, 5)  # every chunk's KV was freed with its session


def test_bfloat16_wire_for_a_float32_route(thread_cluster, tiny_models):
    """--wire-dtype bfloat16: hidden states cross the wire rounded to bfloat16 (half the
    bytes); the tokens are those of a split run that rounds at the same place."""
    from fabric.compute.executor import ShardExecutor
    from fabric.compute.kv import KVStore
    from fabric.compute.models import load_shard, resolve
    from fabric.wire.shard import Shard

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


def test_the_compute_lock_lets_one_process_compute_at_a_time_and_dies_with_its_holder(tmp_path):
    import subprocess
    import sys

    from fabric.compute.compute_lock import ComputeLock

    path = str(tmp_path / "compute.lock")
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from fabric.compute.compute_lock import ComputeLock
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
