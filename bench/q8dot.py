#!/usr/bin/env python
"""The q8dot kernel (int8 activations, integer dot products) against torch's weight-only kernels.

    python bench/q8dot.py [--threads 1,2] [--rows 1,2,4,8] [--reps 5] [--shapes ...]

For each shape (SmolLM2-135M's projections and lm_head, and a 1.7B model's), random weights
are held two ways with the same codes: 4-bit (a Q4_1-like grid: float16 step and minimum per
block of 32) as ``Int4Linear`` on ``torch._weight_int4pack_mm_for_cpu`` and as
``q8dot.DotLinear``; the lm_head as int8 rows on ``torch._weight_int8pack_mm`` and on
``DotLinear``. Both take the same bfloat16 rows, called as the lean layers call them (the
torch operator itself; the module's ``forward``). Each rep times both, alternated (which goes
first alternates too); printed: the median time of each and the ratio torch / q8dot (above 1:
the kernel is faster), and the weights' GB/s through the kernel.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from qmatmul import alternated  # noqa: E402  (the same alternated timing as the qmatmul bench)

SHAPES = {  # name: (out, in, weights): int4 projections, int8 lm_heads
    "smol qkv": (960, 576, "int4"), "smol o": (576, 576, "int4"), "smol gate_up": (3072, 576, "int4"),
    "smol up": (1536, 576, "int4"), "smol down": (576, 1536, "int4"), "smol lm_head": (49152, 576, "int8"),
    "1.7b o": (2048, 2048, "int4"), "1.7b up": (8192, 2048, "int4"), "1.7b down": (2048, 8192, "int4"),
}
DEFAULT = "smol o,smol up,smol down,smol lm_head,1.7b o,1.7b up,1.7b down"


def pair(shape: tuple[int, int, str]):
    """(torch's product, q8dot's product, q8dot's weight bytes) for random weights of ``shape``."""
    from fabric.compute.q8dot import DotLinear
    from fabric.compute.quant import Int4Linear

    out, n, kind = shape
    g = torch.Generator().manual_seed(0)
    if kind == "int8":
        w = torch.randint(-127, 128, (out, n), dtype=torch.int8, generator=g)
        scales = (torch.rand(out, generator=g) * 0.01).to(torch.bfloat16)
        ours = DotLinear.from_int8(w, scales.float())
        return (lambda x: torch._weight_int8pack_mm(x, w, scales)), ours.forward, ours.packed.numel()
    codes = torch.randint(0, 16, (out, n), dtype=torch.uint8, generator=g)
    step = (torch.rand(out, n // 32, generator=g) * 0.01).half().float()
    minimum = (-8 * step).half().float()
    int4 = Int4Linear.packed(codes.to(torch.int32), step, minimum + 8 * step, 32)
    ours = DotLinear.from_grid(_Grid(codes, step, minimum))
    wt, gs, sz = int4.weight, int4.group_size, int4.scales_zeros
    return (lambda x: torch._weight_int4pack_mm_for_cpu(x, wt, gs, sz)), ours.forward, ours.packed.numel()


class _Grid:
    def __init__(self, codes, scale, minimum):
        self.codes, self.scale, self.minimum = codes, scale, minimum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default=DEFAULT, help=f"of: {', '.join(SHAPES)}")
    args = parser.parse_args()
    print(f"time per call, median of {args.reps} alternated reps; ratio = torch / q8dot (above 1: q8dot faster)")
    print(f"{'shape':14} {'out x in':>12} {'thr':>3} {'rows':>4} {'q8dot us':>9} {'torch us':>9} {'ratio':>6} {'GB/s':>6}")
    with torch.inference_mode():
        for name in args.shapes.split(","):
            theirs, ours, nbytes = pair(SHAPES[name])
            out, n, _ = SHAPES[name]
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, n).to(torch.bfloat16)
                    q, t = alternated(ours, theirs, x, args.reps)
                    print(f"{name:14} {f'{out}x{n}':>12} {threads:3} {rows:4} {q * 1e6:9.1f} {t * 1e6:9.1f} "
                          f"{t / q:6.2f} {nbytes / q / 1e9:6.1f}", flush=True)


if __name__ == "__main__":
    main()
