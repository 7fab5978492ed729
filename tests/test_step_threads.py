"""One-token passes on one thread where a check at load finds that no slower (``meshnet node``
without ``--threads``): HopRunner.tune_step_threads and the passes it changes."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from fabric.compute.compute_lock import ComputeLock
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.node.hops import HopRunner
from fabric.node.scheduler import Work
from fabric.wire import protocol as p
from fabric.wire.shard import Shard


@pytest.fixture
def runner(tiny_models):
    source = resolve(str(tiny_models("llama")))
    shard = Shard(0, 5, 6)
    return HopRunner(ShardExecutor(load_shard(source, shard, progress=False), KVStore()), ComputeLock(None),
                     Counter()), shard


def _work(tokens: list[int], session: str = "s", pos: int = 0) -> Work:
    spec = p.TensorSpec("int64", (1, len(tokens)))
    msg = p.Forward(session=session, step=1, pos=pos, start_layer=0, end_layer=5, route=(), reply_to="tcp://h:1",
                    tensors=(spec,))
    return Work(msg, torch.tensor([tokens]))


@pytest.mark.parametrize("one_thread_ms,every_ms,chosen", [(10.1, 10.0, 1), (9.0, 10.0, 1), (13.0, 10.0, 0)])
def test_one_thread_is_taken_only_where_it_is_no_slower(runner, two_threads, monkeypatch, one_thread_ms, every_ms,
                                                          chosen):
    hops, shard = runner
    monkeypatch.setattr(hops, "_step", lambda *a: (one_thread_ms if torch.get_num_threads() == 1 else every_ms) / 1e3)
    assert hops.tune_step_threads(shard, torch.float32) == chosen == hops.step_threads
    assert torch.get_num_threads() == 2  # the check leaves the node's threads as they were


def test_only_a_one_token_pass_runs_on_one_thread_and_the_threads_come_back(runner, two_threads, monkeypatch):
    hops, shard = runner
    seen = []
    for name in ("run", "run_prefills", "run_batch", "run_mixed"):
        inner = getattr(hops.executor, name)
        monkeypatch.setattr(hops.executor, name,
                            lambda *a, inner=inner, **kw: seen.append(torch.get_num_threads()) or inner(*a, **kw))
    hops.step_threads = 1
    hops.run([_work([5, 6, 7])])  # a prompt: every thread
    hops.run([_work([8], pos=3)])  # a decode step: one
    assert seen == [2, 1] and torch.get_num_threads() == 2
    hops.run([_work([5, 6], "a"), _work([7, 8], "b")])  # prompts together: every thread
    assert seen[-1] == 2
    hops.step_threads = 0  # the check found one thread slower, or --threads was given
    hops.run([_work([9], pos=4)])
    assert seen[-1] == 2


def test_a_one_token_pass_on_one_thread_gives_what_one_thread_gives(runner, two_threads):
    """The choice changes the thread count a step runs on, and nothing else: its logits are the
    bits of the same step run with torch set to one thread throughout."""
    hops, shard = runner
    hops.step_threads = 1
    hops.run([_work([5, 6, 7])])
    (tuned,), _, _ = hops.run([_work([8], pos=3)])
    hops.executor.kv.drop("s")
    hops.step_threads = 0
    hops.run([_work([5, 6, 7])])  # the prompt on two threads, as before
    torch.set_num_threads(1)
    (plain,), _, _ = hops.run([_work([8], pos=3)])
    assert torch.equal(tuned.logits, plain.logits)


def test_a_shard_too_slow_to_check_keeps_every_thread(runner, two_threads, monkeypatch):
    """A step long enough that the check would hold the node's start past its budget is no small
    one: the shard keeps every thread, after one step timed."""
    hops, shard = runner
    calls = []
    monkeypatch.setattr(hops, "_step", lambda *a: calls.append(torch.get_num_threads()) or 1.0)
    assert hops.tune_step_threads(shard, torch.float32) == 0 == hops.step_threads
    assert calls == [2]
