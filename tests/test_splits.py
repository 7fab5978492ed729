"""Thread counts learnt per kind of kernel call (fabric/compute/splits.py): timed on one thread
against all, alternated, and the faster kept; a fake clock stands for the calls' durations."""
from __future__ import annotations

import pytest
import torch

from fabric.compute import native, splits
from fabric.compute.splits import Splits

MIDDLING = 8 * native.WORK_PER_THREAD  # threads_for gives it more than one thread, and it is timed


class Calls:
    """A kernel that takes ``took[n]`` seconds on n threads, on a clock of its own."""

    def __init__(self, took: dict[int, float]):
        self.took, self.now, self.ran = took, 0.0, []

    def clock(self) -> float:
        return self.now

    def __call__(self, threads: int) -> int:
        self.ran.append(threads)
        self.now += self.took.get(threads, self.took["else"])
        return 0


def run_many(s: Splits, calls: Calls, n: int, work: int = MIDDLING, threads: int = 2, key: str = "k") -> None:
    for _ in range(n):
        assert s.run(key, work, threads, calls) == 0


@pytest.mark.parametrize("one, every, kept", [(1e-4, 5e-5, 2), (1e-4, 1.4e-4, 1), (1e-4, 0.95e-4, 1)])
def test_a_middling_call_keeps_the_faster_after_alternating(one, every, kept):
    calls = Calls({1: one, 2: every, "else": 1.0})
    s = Splits(clock=calls.clock)
    run_many(s, calls, 2 * splits.SAMPLES)
    assert calls.ran == [1, 2] * splits.SAMPLES  # alternated while trying
    run_many(s, calls, 20)
    assert calls.ran[2 * splits.SAMPLES:] == [kept] * 20  # every thread only where GAIN faster


def test_one_slow_sample_does_not_decide():
    """The median of each side decides: one call preempted in the middle of its run does not."""
    calls = Calls({1: 1e-4, 2: 5e-5, "else": 1.0})
    s = Splits(clock=calls.clock)
    calls.took[2] = 5e-3  # the first call on two threads is preempted
    run_many(s, calls, 2)
    calls.took[2] = 5e-5
    run_many(s, calls, 2 * splits.SAMPLES - 2 + 4)
    assert calls.ran[-4:] == [2, 2, 2, 2]


def test_small_calls_run_on_one_thread_and_large_ones_on_all_untimed():
    calls = Calls({"else": 1.0})
    s = Splits(clock=lambda: pytest.fail("timed a call that needs no timing"))
    run_many(s, calls, 3, work=native.WORK_PER_THREAD - 1, threads=8)
    run_many(s, calls, 3, work=splits.LEARN_BELOW, threads=8)
    run_many(s, calls, 3, work=MIDDLING, threads=1)
    assert calls.ran == [1, 1, 1, 8, 8, 8, 1, 1, 1]
    assert not s.trials and not s.chosen


def test_kinds_learn_apart_and_a_choice_is_timed_again_later(monkeypatch):
    monkeypatch.setattr(splits, "RELEARN", 7)
    calls = Calls({1: 1e-4, 2: 5e-5, 3: 5e-5, "else": 1.0})
    s = Splits(clock=calls.clock)
    run_many(s, calls, 2 * splits.SAMPLES, key="a")
    run_many(s, calls, 2 * splits.SAMPLES, key="b", threads=3)  # another kind: tried afresh
    assert calls.ran[2 * splits.SAMPLES:] == [1, 3] * splits.SAMPLES
    calls.took[2] = 5e-4  # the machine got busy: two threads now lose
    run_many(s, calls, 7, key="a")
    assert calls.ran[-7:] == [2] * 7
    run_many(s, calls, 2 * splits.SAMPLES + 3, key="a")  # timed again: one thread from then on
    assert calls.ran[-3:] == [1, 1, 1]


def test_the_kernels_choose_through_it_and_keep_their_bits(monkeypatch):
    """A q8dot product of middling size goes through the learning, and its rows are the same
    bits on whichever thread count each call took."""
    from fabric.compute import q8dot

    if q8dot.kernel() is None:
        pytest.skip("no C compiler here")
    learnt = Splits()
    monkeypatch.setattr(splits, "SPLITS", learnt)
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (512, 1024), dtype=torch.uint8)
    kind, packed = q8dot.pack_int4(codes, torch.rand(512, 32) * 0.01, -torch.rand(512, 32) * 0.08)
    linear = q8dot.DotLinear(kind, packed, 1024, 512)
    x = torch.randn(8, 1024)  # 4 M multiply-adds: two threads' worth
    with torch.inference_mode():
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            outs = [linear(x) for _ in range(2 * splits.SAMPLES + 2)]
        finally:
            torch.set_num_threads(previous)
    assert list(learnt.chosen) == [((("q8dot", kind, 1024, 512), 4), 2)]
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_settled_answers_what_was_learnt_and_nothing_while_learning(monkeypatch):
    """A caller that runs two products in one kernel call asks ``settled``: None until ``run``
    has learnt the kind of call, then the chosen count, counted as calls until it is timed again."""
    monkeypatch.setattr(splits, "RELEARN", 3)
    calls = Calls({1: 1e-4, 2: 5e-5, "else": 1.0})
    s = Splits(clock=calls.clock)
    assert s.settled("k", MIDDLING, 2) is None
    run_many(s, calls, 2 * splits.SAMPLES)
    assert [s.settled("k", MIDDLING, 2) for _ in range(4)] == [2, 2, 2, None]  # then learnt again
    assert s.settled("k", MIDDLING, 1) == 1 and s.settled("k", native.WORK_PER_THREAD - 1, 8) == 1
    assert s.settled("k", splits.LEARN_BELOW, 8) == 8
