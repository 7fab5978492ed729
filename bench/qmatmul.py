#!/usr/bin/env python
"""The qmatmul kernel (Q5_0/Q5_1/Q5_K/Q8_0 as the file stores them) against torch's int8 kernel.

    python bench/qmatmul.py [--threads 1] [--rows 1,8,64,256] [--reps 7] [--types Q5_0,Q5_K,Q8_0]

For each type and shape (SmolLM2-135M's, Gemma 3 270M's and a 1B model's projections), a
random weight is written in the type (tests/gguf_models.py's encoder), then held two ways:
``BlockLinear`` (the file's codes, fabric/compute/kernels/qmatmul.c) and ``Int8Linear`` (the
same weights re-rounded onto int8 rows: what the default mode ran before). Both take the same
bfloat16 rows. Each rep times both, alternated (which goes first alternates too), for
``--reps`` reps; printed: the median time of each and the ratio int8 / qmatmul (above 1: the
kernel is faster), and each one's bytes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {  # (out, in) of a model's projections
    "smollm2 up": (1536, 576), "smollm2 down": (576, 1536),
    "gemma3-270m up": (2048, 640), "gemma3-270m down": (640, 2048),
    "1b up": (8192, 2048), "1b down": (2048, 8192),
}


def timed(fn, x: torch.Tensor, budget_s: float = 0.05) -> float:
    """Seconds per call: as many calls as fit ``budget_s`` (at least 3), the best of 3 such rounds' means."""
    fn(x)
    start = time.perf_counter()
    fn(x)
    n = max(3, int(budget_s / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn(x)
        best = min(best, (time.perf_counter() - start) / n)
    return best


def pair(type_name: str, shape: tuple[int, int]):
    from fabric.compute.qblock import BlockLinear, blocks_from_raw, file_weights
    from fabric.compute.quant import Int8Linear, quantize_weight
    from tests.gguf_models import encode

    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.02
    blocks = blocks_from_raw(encode(w, type_name), type_name)
    ours = BlockLinear(blocks)
    int8 = Int8Linear(*quantize_weight(file_weights(blocks).to(torch.bfloat16)))
    nbytes = (sum(p.numel() * p.element_size() for p in ours.parameters()),
              sum(p.numel() * p.element_size() for p in int8.parameters()))
    return ours, int8, nbytes



def alternated(ours, theirs, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """Median seconds per call of ``ours`` and ``theirs`` on x, timed in alternating order."""
    mine, other = [], []
    for rep in range(reps):
        for fn, times in [(ours, mine), (theirs, other)][:: 1 if rep % 2 == 0 else -1]:
            times.append(timed(fn, x))
    return statistics.median(mine), statistics.median(other)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--types", default="Q5_0,Q5_K,Q8_0")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; time per call, median of {args.reps} alternated reps; ratio = int8 / qmatmul")
    print(f"{'type':6} {'shape':18} {'rows':>5} {'qmatmul us':>11} {'int8 us':>9} {'ratio':>6}  bytes q/int8")
    with torch.inference_mode():
        for type_name in args.types.split(","):
            for name in args.shapes.split(","):
                shape = SHAPES[name]
                if type_name == "Q5_K" and shape[1] % 256:
                    continue
                ours, int8, (qb, ib) = pair(type_name, shape)
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, shape[1]).to(torch.bfloat16)
                    q, i = alternated(ours, int8, x, args.reps)
                    print(f"{type_name:6} {name:18} {rows:5} {q * 1e6:11.1f} {i * 1e6:9.1f} {i / q:6.2f}  "
                          f"{qb / ib:.2f}", flush=True)


if __name__ == "__main__":
    main()
