"""Decode passes at once (``--decode-threads``): nodes sharing a machine's compute lock run passes
of decode steps alone without it, each on its share of the cores, and stop gathering their
streams into one batch, so the streams run as a pipeline of groups. Prompts keep the lock, but
for their last few tokens (a decode step's work)."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import threading
from collections import Counter

import pytest
import torch

from fabric.compute.compute_lock import RECOUNT_S, ComputeLock, Members
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.node.hops import HopRunner, decodes_at_once
from fabric.node.scheduler import (
    LIGHT_TOKENS,
    SPLIT_FROM,
    HopScheduler,
    Replay,
    SchedulerConfig,
    Work,
)
from fabric.wire import protocol as p
from fabric.wire.shard import Shard


def _work(tokens: list[int], session: str, pos: int = 0, drafts: tuple[int, ...] = ()) -> Work:
    spec = p.TensorSpec("int64", (1, len(tokens)))
    msg = p.Forward(session=session, step=1, pos=pos, start_layer=0, end_layer=5, route=(), reply_to="tcp://h:1",
                    tensors=(spec,), drafts=drafts)
    return Work(msg, torch.tensor([tokens]))


@pytest.fixture
def held(tmp_path):
    """The compute lock file, held by another node of the machine (another open file: flock
    locks belong to the open file, so this process's own lock conflicts with it)."""
    other = ComputeLock(str(tmp_path / "compute.lock"))
    other.acquire()
    yield str(tmp_path / "compute.lock")
    other.release()
    other.close()


def _node(tiny_models, lock_path: str, decode: int) -> tuple[HopRunner, HopScheduler, list[int]]:
    """A runner and scheduler as a node builds them, over a tiny llama's 6 layers, with two sessions
    prefilled (without the lock: the test holds it elsewhere); the threads of each pass are kept."""
    kv = KVStore()
    runner = HopRunner(ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(0, 5, 6), progress=False),
                                     kv), ComputeLock(lock_path), Counter(), decode_threads=decode)
    scheduler = HopScheduler(SchedulerConfig(), kv, shared_lock=True, gather=not decode)
    for session in "ab":
        runner.executor.run(session, 0, 5, torch.tensor([[5, 6, 7]]), 0)
    seen: list[int] = []
    for name in ("run", "run_batch", "run_mixed", "run_prefills"):
        inner = getattr(runner.executor, name)
        setattr(runner.executor, name, lambda *a, inner=inner, **kw: seen.append(torch.get_num_threads()) or inner(*a, **kw))
    return runner, scheduler, seen


def _in_time(call, seconds: float = 20.0):
    """``call()``'s result; fails where it blocks (on a lock it must not wait for) past ``seconds``."""
    out = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, "blocked"
    return out[0]


def test_decode_steps_run_at_once_on_their_threads_while_another_node_holds_the_lock(tiny_models, held,
                                                                                    two_threads):
    runner, scheduler, seen = _node(tiny_models, held, decode=1)
    scheduler.push(_work([8], "a", pos=3))
    scheduler.push(_work([9], "b", pos=3))
    assert runner.ready(scheduler)  # the other node computes, and these go ahead
    batch = scheduler.next_batch()
    results, _, _ = _in_time(lambda: runner.run(batch))
    runner.done()
    assert [r.logits.dim() for r in results] == [1, 1]  # the tail's (the shard holds every layer)
    assert seen == [1] and torch.get_num_threads() == 2  # one thread for the pass, every thread after


def test_a_prompts_last_token_after_kept_kv_runs_at_once_as_a_decode_step(tiny_models, held, two_threads):
    """A prompt asked again continues its kept KV with its last token: a decode step's work. It
    goes ahead on the decode pass's threads beside the streams' steps, as they do, instead of
    waiting for the lock and every thread (8 streams' last first token 106 against 85 ms on the
    AVX2 paths, docs/BENCHMARKS.md, "Taps nobody could read"); so does a whole prompt of
    LIGHT_TOKENS tokens."""
    runner, scheduler, seen = _node(tiny_models, held, decode=1)
    runner.executor.kv.retained.budget = 1 << 20
    runner.executor.run("kept", 0, 5, torch.tensor([[1, 2, 3, 4, 5, 6]]), 0)
    runner.executor.retain("kept")
    whole = runner.executor.run("x", 0, 5, torch.tensor([[1, 2, 3, 4, 5, 6]]), 0).logits
    seen.clear()
    scheduler.push(_work([8], "a", pos=3))
    chunk = _work([6], "d", pos=5)
    scheduler.push(Work(dataclasses.replace(chunk.msg, reuse="kept"), chunk.tensor))
    scheduler.push(_work(list(range(1, LIGHT_TOKENS + 1)), "c"))
    assert scheduler.narrow() and runner.ready(scheduler)  # the other node holds the lock: these go ahead
    batch = scheduler.next_batch()
    results, _, _ = _in_time(lambda: runner.run(batch))
    runner.done()
    assert [w.session for w in batch] == ["a", "d", "c"] and seen == [1]
    assert torch.allclose(results[1].logits, whole, atol=1e-4)  # it went on from the kept KV


@pytest.mark.parametrize("other", ["prompt", "verification", "replay"])
def test_a_prompt_a_verification_or_a_replay_still_waits_for_the_lock(tiny_models, held, two_threads, other):
    runner, scheduler, _ = _node(tiny_models, held, decode=1)
    scheduler.push(_work([8], "a", pos=3))
    if other == "prompt":
        scheduler.push(_work(list(range(1, LIGHT_TOKENS + 2)), "c"))
    elif other == "verification":
        scheduler.push(_work([9, 10, 11], "b", pos=3, drafts=(10, 11)))
    else:
        assert scheduler.push_replay(Replay(msg=None, tensor=None))
    assert not scheduler.narrow()
    assert not runner.ready(scheduler) and runner.lock.pending  # its waiter waits for the other node
    runner.lock.close()


def test_without_decode_threads_decode_steps_wait_for_the_lock_too(tiny_models, held, two_threads):
    runner, scheduler, _ = _node(tiny_models, held, decode=0)
    scheduler.push(_work([8], "a", pos=3))
    assert scheduler.narrow() and not runner.ready(scheduler)
    runner.lock.close()


def test_nodes_that_decode_at_once_wait_only_for_their_own_group():
    """A gathering node waits up to a pass for every session due (one batch for all streams: the
    other nodes idle meanwhile). One that decodes at once waits only for the sessions that ran in
    the same pass here last time (the node before sends them one by one), never for another
    group, which is computing at another node."""
    def node(gather: bool) -> HopScheduler:
        s = HopScheduler(SchedulerConfig(), {"a", "b", "c"}, gather=gather)
        s.push(_work([8], "a", pos=40))
        s.decode_batch_s = s.pass_s = 0.04
        s.cycle_s = 0.1
        s.last_decode = {"a": 9.9, "b": 9.95, "c": 9.95}  # "b" and "c": another group, due here
        return s

    assert node(gather=True).wait(10.0) == pytest.approx(0.04)
    assert node(gather=False).wait(10.0) == 0
    mates = node(gather=False)
    mates.last_decode["b"] = 9.9  # "b" ran with "a": on its way
    assert mates.wait(10.0) == pytest.approx(0.04)
    mates.push(_work([9], "b", pos=40))
    assert mates.wait(10.001) == 0 and [w.session for w in mates.next_batch()] == ["a", "b"]


@pytest.mark.parametrize("streams", [7, 8, 9, 16])
def test_many_streams_run_as_two_groups_where_nodes_decode_at_once(streams):
    """One group leaves every node but one idle; at nodes that decode at once (each on its own
    cores) SPLIT_FROM streams or more run as two groups, one computing here while the other is at
    the next node. A gathering node runs one batch."""
    sessions = [f"s{i}" for i in range(streams)]

    def batches(gather: bool) -> list[int]:
        s = HopScheduler(SchedulerConfig(), set(sessions), gather=gather)
        s.last_decode = dict.fromkeys(sessions, 9.9)
        for session in sessions:
            s.push(_work([8], session, pos=40))
        return [len(s.next_batch()) for _ in range(2) if len(s)]

    assert batches(gather=True) == [streams]
    assert batches(gather=False) == ([streams] if streams < SPLIT_FROM else [(streams + 1) // 2, streams // 2])


def test_a_burst_of_prompts_reaches_the_next_node_in_two_halves_and_decodes_as_two_groups():
    """Prompts that arrive together run their last pieces in two passes of half the streams they
    make (riding a stream's decode step here, or alone), not one: the next node computes the
    first half while this one computes the second, so the burst's first tokens come sooner (one
    pass of eight held both nodes up in turn: docs/BENCHMARKS.md, "Taps nobody could read").
    Each of their sessions decodes here next, counted among the streams from its pass on: they
    run as two groups from their first decode step, not a round later (a group of seven and a
    group of one: one node idles while the other runs the seven)."""
    sessions = [f"s{i}" for i in range(SPLIT_FROM)]
    s = HopScheduler(SchedulerConfig(), set(sessions), gather=False)
    s.last_decode = {"s0": 9.9}  # decoding here already; the others' prompts are queued
    s.push(_work([8], "s0", pos=40))
    for session in sessions[1:]:
        s.push(_work([1, 2, 3], session, pos=0))
    halves = [s.next_batch(), s.next_batch()]
    assert [[w.session for w in b] for b in halves] == [sessions[:4], sessions[4:]]
    assert halves[0][0].decode and not any(w.decode for w in halves[0][1:] + halves[1])
    for started, half in zip((10.0, 10.02), halves):
        s.ran(half, started, 0.02)
    for session in sessions:
        s.push(_work([9], session, pos=41))
    assert [len(s.next_batch()) for _ in range(2)] == [SPLIT_FROM // 2] * 2
    idle = HopScheduler(SchedulerConfig(), set(), gather=False)  # and with nothing decoding here yet
    for session in sessions:
        idle.push(_work([1, 2, 3], session, pos=0))
    assert [len(idle.next_batch()) for _ in range(2)] == [SPLIT_FROM // 2] * 2


def test_streams_a_wait_gave_up_on_still_count_toward_two_groups():
    """A stream's step that waited a pass's time for the rest of its group in vain runs alone;
    the group's seven, when they come, are still seven of eight streams here: they run as four
    and three (the give-up stops the waiting, not the count)."""
    sessions = [f"s{i}" for i in range(SPLIT_FROM)]
    s = HopScheduler(SchedulerConfig(), set(sessions), gather=False)
    s.cycle_s = 0.1
    s.ran([_work([8], session, pos=40) for session in sessions], 10.0, 0.02)  # one pass of all eight
    s.push(_work([9], "s0", pos=41))
    assert s.wait(10.03) == pytest.approx(0.02) and s.wait(10.06) == 0  # waited for the seven, then gave up
    alone = s.next_batch()
    s.ran(alone, 10.06, 0.005)
    for session in sessions[1:]:
        s.push(_work([9], session, pos=3))
    assert [w.session for w in alone] == ["s0"] and [len(s.next_batch()) for _ in range(2)] == [4, 3]


def test_prompts_at_a_node_that_decodes_at_once_never_wait_for_streams_to_come_back():
    """Under a shared compute lock a gathering node holds a prompt's next piece back, for a cycle at
    most, until the streams it just ran come back: another piece now would hold the lock while the
    other node has their decode steps to run. A node that decodes at once runs those without the
    lock, so the wait buys nothing; at a burst's start it held the next prompts back for the first
    stream's whole round trip (8 streams' last first token 114 against 93 ms, docs/BENCHMARKS.md,
    "Taps nobody could read")."""
    def node(gather: bool) -> HopScheduler:
        s = HopScheduler(SchedulerConfig(), {"a", "b", "c"}, shared_lock=True, gather=gather)
        s.push(_work([1, 2, 3], "a"))
        s.ran(s.next_batch(), 10.0, 0.01)  # "a"'s prompt ran: it decodes here next
        s.push(_work([4, 5], "b"))
        s.cycle_s = 0.1
        return s

    assert node(gather=True).wait(10.02) == pytest.approx(0.1)
    assert node(gather=False).wait(10.02) == 0


def test_quantized_cpu_nodes_of_a_split_model_decode_at_once_by_default():
    """`meshnet node` without --decode-threads: a quantized CPU node of a split model decodes at
    once (its streams a pipeline of groups, on this machine or across machines); float weights (one
    gathered batch is faster), a GPU, or a node holding every layer (no next node to keep busy)
    gather as before."""
    assert decodes_at_once("cpu", "gguf", Shard(0, 14, 30)) and decodes_at_once("cpu", "int4", Shard(15, 29, 30))
    assert decodes_at_once("cpu", "int8", Shard(3, 5, 30))
    assert not decodes_at_once("cpu", None, Shard(0, 14, 30)) and not decodes_at_once("cpu", "none", Shard(0, 14, 30))
    assert not decodes_at_once("cuda:0", "gguf", Shard(0, 14, 30)) and not decodes_at_once("cpu", "gguf", Shard(0, 29, 30))


def _recount(members: Members) -> int:
    members._at = -RECOUNT_S  # the next count looks at the directory again
    return members.count()


def test_nodes_sharing_a_lock_count_one_another_as_they_come_and_go(tmp_path):
    """Each node holds a file of its own beside the compute lock; the count is who holds one now."""
    lock = str(tmp_path / "compute.lock")
    a = Members(lock)
    assert _recount(a) == 1
    b = Members(lock)
    assert _recount(a) == _recount(b) == 2
    b.close()
    assert _recount(a) == 1 and len(list((tmp_path / "compute.lock.nodes").iterdir())) == 1
    assert Members(None).count() == 1  # no lock (--compute-lock none): alone
    a.close()


def test_a_killed_nodes_file_is_not_counted_and_is_removed(tmp_path):
    """A node killed with SIGKILL cannot remove its file: the kernel drops its flock, and the next
    count finds the file unheld, removes it and counts the living."""
    lock = str(tmp_path / "compute.lock")
    me = Members(lock)
    code = ("import sys, time; from fabric.compute.compute_lock import Members; m = Members(sys.argv[1]); "
            "print('in', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "in"
        assert _recount(me) == 2
        other.kill()
        other.wait(10)
        assert _recount(me) == 1
        assert len(list((tmp_path / "compute.lock.nodes").iterdir())) == 1  # its file is gone, mine stays
    finally:
        other.kill()
        me.close()


def test_decode_threads_follow_the_nodes_on_this_machine(tiny_models, tmp_path, monkeypatch):
    """A node's decode threads are its CPUs over the nodes sharing its lock, at most torch's threads:
    all of them alone (each of two machines with a node of its own), half with a second node here,
    all again once it leaves."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    lock = str(tmp_path / "compute.lock")
    executor = ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(0, 5, 6), progress=False), KVStore())
    runner = HopRunner(executor, ComputeLock(lock), Counter(), members=Members(lock))
    assert runner.decode_threads == 6  # alone: every thread torch has (6 of 8 CPUs)
    other = Members(lock)
    _recount(runner.members)
    runner.share_cores()
    assert runner.decode_threads == 4
    other.close()
    _recount(runner.members)
    runner.share_cores()
    assert runner.decode_threads == 6
    runner.members.close()


def test_a_vanished_directory_keeps_the_last_count(tmp_path):
    """A cleaned /tmp takes the directory away under a running node: the count stands, no error."""
    lock = str(tmp_path / "compute.lock")
    a, b = Members(lock), Members(lock)
    assert _recount(a) == 2
    shutil.rmtree(tmp_path / "compute.lock.nodes")
    assert _recount(a) == 2
    a.close()
    b.close()
