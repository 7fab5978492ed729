"""How many threads a kernel call runs on: learnt per kind of call, from the calls themselves.

Splitting a product over threads saves part of its time and costs a wake of the OpenMP workers,
which sleep between parallel regions in a node (fabric/cli/torch_env.py). What a wake costs
depends on the machine, and what a split saves on the product's shape and row count: on the
2-core machine of docs/BENCHMARKS.md (*Threads for a batch's products*), with the workers
asleep, an 8-row product of 576 x 576 took 71 us on one thread and 141 on two, one of 576 x
3072 173 and 186 us, and the lm_head's 576 x 49152 2.25 ms and 1.31 ms. No fixed size gets
both right on every machine, so a call of middling size (``native.threads_for`` gives it
more than one thread, and it is under ``LEARN_BELOW`` multiply-adds) is timed: its first
2 x ``SAMPLES`` calls alternate one thread and all it may use, and it keeps all only where
they were at least ``GAIN`` faster (the median of each). ``RELEARN`` calls later it is timed
again, as a machine's load changes. Smaller calls run on one thread, larger ones on all,
untimed. A kernel's bits never depend on its thread count, so trying costs time, never a
different answer.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable

from . import native

SAMPLES = 5  # timed calls on each side before choosing
GAIN = 0.9  # every thread is kept only where at least this much faster than one (median / median)
LEARN_BELOW = 128_000_000  # multiply-adds from which a call always splits: one thread takes milliseconds
RELEARN = 4096  # calls after which a kind of call is timed again


class Splits:
    """The thread count chosen per kind of call, and the timings of the kinds still being tried."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.chosen: dict[Hashable, list[int]] = {}  # key -> [threads, calls left before timing again]
        self.trials: dict[Hashable, tuple[list[float], list[float]]] = {}  # key -> (one thread, every thread)

    def run(self, key: Hashable, work: int, threads: int, call: Callable[[int], int]) -> int:
        """``call(n)`` on the thread count chosen for calls of ``key`` doing ``work``
        multiply-adds with ``threads`` allowed; returns what ``call`` returns."""
        n = self.settled(key, work, threads)
        if n is not None:
            return call(n)
        n = native.threads_for(work, threads)
        return self._trial((key, n), n, call)

    def settled(self, key: Hashable, work: int, threads: int) -> int | None:
        """The thread count of such a call now, counted as one call of ``key``; None while calls
        of ``key`` are still timed (``run`` then times this one). ``run`` asks it first; a caller
        that runs several products in one kernel call asks it for each."""
        if threads == 1:  # a node's decode threads are often one: nothing to choose
            return 1
        n = native.threads_for(work, threads)
        if n == 1 or work >= LEARN_BELOW:
            return n
        chosen = self.chosen.get((key, n))
        if chosen is None:
            return None
        chosen[1] -= 1
        if chosen[1] <= 0:
            del self.chosen[key, n]
        return chosen[0]

    def _trial(self, key: Hashable, n: int, call: Callable[[int], int]) -> int:
        one, every = self.trials.setdefault(key, ([], []))
        threads = 1 if len(one) <= len(every) else n
        began = self.clock()
        result = call(threads)
        (one if threads == 1 else every).append(self.clock() - began)
        if len(every) >= SAMPLES:
            faster = statistics.median(every) <= GAIN * statistics.median(one)
            self.chosen[key] = [n if faster else 1, RELEARN]
            del self.trials[key]
        return result


SPLITS = Splits()  # the process's: every kernel call shares what was learnt


def run(key: Hashable, work: int, threads: int, call: Callable[[int], int]) -> int:
    return SPLITS.run(key, work, threads, call)


def settled(key: Hashable, work: int, threads: int) -> int | None:
    return SPLITS.settled(key, work, threads)
