"""The default mode's attention, one layer's call, against SDPA and against its torch path.

SmolLM2-135M's shape (9 query heads, 3 key heads, head size 64), bfloat16, for a one-token
step and a prefill chunk at several context lengths. Each figure is the CPU time of one
call (process time, so a busy neighbour costs less than in wall time), the median of
``--reps`` runs of ``--calls`` calls each, the three alternated within every rep. SDPA gets
the mask transformers gives it (a chunk after earlier keys is not top-left causal).

    python bench/attention_kernel.py [--threads 1] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fabric.compute import attention, native  # noqa: E402

SHAPES = [(1, 100), (1, 1000), (1, 2000), (64, 100), (64, 1000), (256, 2000)]  # (queries, keys)


def cpu_us(call, calls: int) -> float:
    call()
    start = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - start) / calls * 1e6


def calls_for(q: int, k: int, kernel) -> dict:
    query = torch.randn(1, 9, q, 64, dtype=torch.bfloat16)
    key, value = torch.randn(1, 3, k, 64, dtype=torch.bfloat16), torch.randn(1, 3, k, 64, dtype=torch.bfloat16)
    keys, values = key.repeat_interleave(3, 1), value.repeat_interleave(3, 1)  # as transformers' SDPA path
    mask = attention._keep(None, q, k, "cpu") if q > 1 else None
    return {"kernel": lambda: attention._native(kernel, query, key, value, None, None, None),
            "sdpa": lambda: F.scaled_dot_product_attention(query, keys, values, attn_mask=mask),
            "torch path": lambda: attention._tiled(query, key, value, None, None, None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native.library("attention")
    if kernel is None:
        print("the C kernel could not be built here (see the warning above)")
        return 1
    print(f"CPU µs per call, {args.threads} thread(s), median of {args.reps} reps; ratio: SDPA / kernel")
    for q, k in SHAPES:
        calls = calls_for(q, k, kernel)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, call in calls.items():
                times[name].append(cpu_us(call, max(3, 20000 // (q * k // 64 + 50))))
        med = {name: statistics.median(v) for name, v in times.items()}
        print(f"  {q:>3} queries, {k:>4} keys: kernel {med['kernel']:8.0f}  sdpa {med['sdpa']:8.0f}  "
              f"torch path {med['torch path']:8.0f}  -> kernel {med['sdpa'] / med['kernel']:.2f}x SDPA, "
              f"{med['torch path'] / med['kernel']:.2f}x the torch path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
