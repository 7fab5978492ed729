"""What logprobs and penalties cost the tail per token, against sampling alone.

No model and no sockets: one row of random float32 logits of each vocabulary size, and the
tail's own functions (fabric/node/asks.py) on it, each timed as the median of ``--reps``
calls, alternated in rounds so that a busy neighbour slows all alike. A session that asks
for none of them runs only the greedy sample (and one lookup in an empty map). Prints
microseconds per token and each cost as a multiple of the greedy sample.

    python bench/logprobs_cost.py [--vocab 32000 151936] [--reps 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fabric.compute.sampling import sample  # noqa: E402
from fabric.node.asks import Ask, logprobs_of  # noqa: E402
from fabric.wire import protocol as p  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median microseconds of one call."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    for vocab in args.vocab:
        logits = torch.randn(vocab)  # (vocab,)
        ask = Ask(-1, p.Penalties(0.5, 0.5, tuple(range(10)), (1.0,) * 10))
        ask.counts.update(range(256))  # a 256-token reply so far
        cases = {"greedy sample": lambda: sample(logits, p.Sampling(), 7),
                 "logprobs, top 0": lambda: logprobs_of(logits, 3, 0),
                 "logprobs, top 20": lambda: logprobs_of(logits, 3, 20),
                 "penalties + 10 biases": lambda: ask.adjust(logits)}
        runs: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                runs[name].append(timed(fn, args.reps))
        base = statistics.median(runs["greedy sample"])
        for name, values in runs.items():
            us = statistics.median(values)
            print(f"vocab {vocab:>6}  {name:<22} {us:8.1f} us/token  {us / base:6.1f}x the greedy sample")


if __name__ == "__main__":
    main()
