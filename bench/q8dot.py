#!/usr/bin/env python
"""The q8dot kernel (int8 activations, integer dot products) against torch's weight-only kernels.

    python bench/q8dot.py [--threads 1,2] [--rows 1,2,4,8] [--reps 5] [--shapes ...] [--pipe] [--cold MIB]
                          [--other DIR]

For each shape (SmolLM2-135M's projections and lm_head, and a 1.7B model's), random weights
are held two ways with the same codes: 4-bit (a Q4_1-like grid: float16 step and minimum per
block of 32) as ``Int4Linear`` on ``torch._weight_int4pack_mm_for_cpu`` and as
``q8dot.DotLinear``; the lm_head as int8 rows on ``torch._weight_int8pack_mm`` and on
``DotLinear``. Both take the same bfloat16 rows, called as the lean layers call them (the
torch operator itself; the module's ``forward``). Each rep times both, alternated (which goes
first alternates too); printed: the median time of each and the ratio torch / q8dot (above 1:
the kernel is faster), and the weights' GB/s through the kernel.

``--cold MIB`` holds enough copies of each shape's weights (other random codes) to fill MIB,
taken in turn, so each call reads its weights from memory, as a pass's products do (one
copy stays in the cache between calls, which times the arithmetic alone).

``--other DIR`` times this checkout's kernel against DIR's (another checkout: ``git worktree add
/tmp/old HEAD~1``), its ``kernels/q8dot.c`` built with the flags this machine's build takes
(``MESHNET_NATIVE_ARCH`` included), on the same weights, instead of against torch: ratio = DIR's
time / this checkout's (above 1: this checkout is faster).

The ``q4_k`` shapes (not in the default list) time random weights as a Q4_K file holds them,
on the kernel's ``int4_k`` (the file's factors, multiplied out in the kernel) against the same
weights as ``int4_f32`` (float32 steps and minima, 1.17x the bytes), in the torch column.

``--pipe`` (a build on the AVX2 path): how near each call comes to the CPU's integer multiply
rate, measured first by a loop of independent ``vpmaddubsw`` (8 chains, one thread), alone and
each widened by a ``vpmaddwd``. The AVX2 path makes one ``vpmaddubsw`` per 32 products (8
outputs by 4 inputs of a row); an int8 product widens each at once. ``pipe`` = the call's
``vpmaddubsw`` at the loop's rate (alone for int4, widened for int8) over the call's time,
per thread.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from qmatmul import alternated  # noqa: E402  (the same alternated timing as the qmatmul bench)

SHAPES = {  # name: (out, in, weights): int4 projections, int8 lm_heads
    "smol qkv": (960, 576, "int4"), "smol o": (576, 576, "int4"), "smol gate_up": (3072, 576, "int4"),
    "smol up": (1536, 576, "int4"), "smol down": (576, 1536, "int4"), "smol lm_head": (49152, 576, "int8"),
    "1.7b o": (2048, 2048, "int4"), "1.7b up": (8192, 2048, "int4"), "1.7b down": (2048, 8192, "int4"),
    "q4_k up": (8192, 2048, "q4_k"), "q4_k down": (2048, 8192, "q4_k"), "q4_k small": (1536, 768, "q4_k"),
}
DEFAULT = "smol o,smol up,smol down,smol lm_head,1.7b o,1.7b up,1.7b down"


def pair(shape: tuple[int, int, str], seed: int = 0, other=None):
    """(torch's product, q8dot's product, q8dot's weight bytes) for random weights of ``shape``;
    with ``other`` (a built kernel), that kernel's product of the same weights in torch's place."""
    from fabric.compute.q8dot import DotLinear
    from fabric.compute.quant import Int4Linear

    out, n, kind = shape
    g = torch.Generator().manual_seed(seed)
    if kind == "q4_k":
        return _q4_k_pair(out, n, seed)
    if kind == "int8":
        w = torch.randint(-127, 128, (out, n), dtype=torch.int8, generator=g)
        scales = (torch.rand(out, generator=g) * 0.01).to(torch.bfloat16)
        ours = DotLinear.from_int8(w, scales.float())
        if other is not None:
            return on_kernel(DotLinear.from_int8(w, scales.float()), other), ours.forward, ours.packed.numel()
        return (lambda x: torch._weight_int8pack_mm(x, w, scales)), ours.forward, ours.packed.numel()
    codes = torch.randint(0, 16, (out, n), dtype=torch.uint8, generator=g)
    step = (torch.rand(out, n // 32, generator=g) * 0.01).half().float()
    minimum = (-8 * step).half().float()
    int4 = Int4Linear.packed(codes.to(torch.int32), step, minimum + 8 * step, 32)
    ours = DotLinear.from_grid(_Grid(codes, step, minimum))
    if other is not None:
        return on_kernel(DotLinear.from_grid(_Grid(codes, step, minimum)), other), ours.forward, ours.packed.numel()
    wt, gs, sz = int4.weight, int4.group_size, int4.scales_zeros
    return (lambda x: torch._weight_int4pack_mm_for_cpu(x, wt, gs, sz)), ours.forward, ours.packed.numel()


def _q4_k_pair(out: int, n: int, seed: int):
    """Random weights as a Q4_K file holds them: the kernel's ``int4_k`` (the file's factors) and,
    in torch's place, ``int4_f32`` (the same steps and minima multiplied out as float32)."""
    import dataclasses

    from fabric.compute.q8dot import DotLinear
    from tests.gguf_models import file_grid

    _, grid = file_grid(np.random.default_rng(seed).standard_normal((out, n)).astype(np.float32), "Q4_K")
    ours, f32 = DotLinear.from_grid(grid), DotLinear.from_grid(dataclasses.replace(grid, factors=None))
    return f32.forward, ours.forward, ours.packed.numel()


MADDUBS_LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
/* 8 independent chains in registers (an array of accumulators lives on the stack at -O2, and its
   loads and stores, not the multiplier, set the pace): vpmaddubsw alone (int4), then each with the
   vpmaddwd that widens it (int8). */
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
int main(void) {
#define INIT(i) __m256i a##i = _mm256_set1_epi8((char)(i + 1)), c##i = _mm256_setzero_si256();
    CHAINS(INIT)
    __m256i b = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    long n = 20000000;
    double t = now();
    for (long k = 0; k < n; k++) {
#define ALONE(i) c##i = _mm256_add_epi16(c##i, _mm256_maddubs_epi16(a##i, b));
        CHAINS(ALONE)
        __asm__ volatile("" : "+x"(b));
    }
    double alone = now() - t;
    t = now();
    for (long k = 0; k < n; k++) {
#define WIDENED(i) c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_maddubs_epi16(a##i, b), ones));
        CHAINS(WIDENED)
        __asm__ volatile("" : "+x"(b));
    }
    double widened = now() - t;
    __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                 _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
    printf("%.6g %.6g %d\\n", 8.0 * n / alone, 8.0 * n / widened, _mm256_extract_epi16(s, 0));
    return 0;
}
"""


def maddubs_rates(reps: int = 3) -> dict[str, float]:
    """This core's ``vpmaddubsw`` (256-bit) a second, alone ("int4") and each widened by a
    ``vpmaddwd`` ("int8"): the best of ``reps`` runs of the loop."""
    with tempfile.TemporaryDirectory() as d:
        source, binary = os.path.join(d, "loop.c"), os.path.join(d, "loop")
        Path(source).write_text(MADDUBS_LOOP)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx2", source, "-o", binary], check=True)
        runs = [subprocess.run([binary], capture_output=True, text=True, check=True).stdout.split() for _ in range(reps)]
    return {"int4": max(float(r[0]) for r in runs), "int8": max(float(r[1]) for r in runs)}


def multiplies(shape: tuple[int, int, str]) -> int:
    """The ``vpmaddubsw`` the AVX2 path makes for one row (tiles of 16 outputs; 32 products each)."""
    out, n, _ = shape
    return -(-out // 16) * 16 * n // 32


def on_kernel(layer, lib):
    """``layer``'s product on the built kernel ``lib``."""
    layer._kernel, layer._job = lib, None  # the job is built anew on it
    return layer.forward


def other_kernel(checkout: str, build_dir: str):
    """``checkout``'s ``kernels/q8dot.c``, built into ``build_dir`` with this machine's flags, loaded."""
    import ctypes

    from fabric.compute import native, q8dot

    source = Path(checkout) / "fabric" / "compute" / "kernels" / "q8dot.c"
    target = os.path.join(build_dir, "q8dot_other.so")
    subprocess.run([os.environ.get("CC", "cc"), *native.flags(), "-o", target, str(source), "-lm"], check=True)
    return q8dot.declared(ctypes.CDLL(target))


def in_turn(shape: tuple[int, int, str], cold_bytes: int, other=None):
    """``pair`` for copies of ``shape``'s weights filling ``cold_bytes`` (one at least), each
    product calling the next copy."""
    first = pair(shape, 0, other)
    copies = [first] + [pair(shape, seed, other) for seed in range(1, -(-cold_bytes // first[2]))]
    turn = {"theirs": 0, "ours": 0}

    def taking(side: int, name: str):
        def call(x):
            turn[name] = (turn[name] + 1) % len(copies)
            return copies[turn[name]][side](x)
        return call

    return taking(0, "theirs"), taking(1, "ours"), first[2]


class _Grid:
    factors = None  # not a Q4_K file's

    def __init__(self, codes, scale, minimum):
        self.codes, self.scale, self.minimum = codes, scale, minimum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default=DEFAULT, help=f"of: {', '.join(SHAPES)}")
    parser.add_argument("--pipe", action="store_true", help="each call against the CPU's vpmaddubsw rate (AVX2 path)")
    parser.add_argument("--cold", type=int, default=0, metavar="MIB",
                        help="copies of the weights filling MIB, taken in turn: each call reads from memory")
    parser.add_argument("--other", metavar="DIR", help="against DIR's kernel (another checkout) instead of torch")
    args = parser.parse_args()
    rate = _pipe_rates() if args.pipe else {}
    other = other_kernel(args.other, tempfile.mkdtemp(prefix="q8dot-other-")) if args.other else None
    base = "other" if other is not None else "torch"
    print(f"time per call, median of {args.reps} alternated reps; ratio = {base} / q8dot (above 1: q8dot faster)")
    print(f"{'shape':14} {'out x in':>12} {'thr':>3} {'rows':>4} {'q8dot us':>9} {base + ' us':>9} {'ratio':>6} {'GB/s':>6}"
          + (f" {'pipe':>5}" if rate else ""))
    with torch.inference_mode():
        for name in args.shapes.split(","):
            theirs, ours, nbytes = in_turn(SHAPES[name], args.cold << 20, other)
            out, n, kind = SHAPES[name]
            loop = rate.get("int8" if kind == "int8" else "int4")  # q4_k makes int4's multiplies
            pipe_per_row = multiplies(SHAPES[name]) / loop if rate else 0.0  # seconds at the loop's rate
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, n).to(torch.bfloat16)
                    q, t = alternated(ours, theirs, x, args.reps)
                    print(f"{name:14} {f'{out}x{n}':>12} {threads:3} {rows:4} {q * 1e6:9.1f} {t * 1e6:9.1f} "
                          f"{t / q:6.2f} {nbytes / q / 1e9:6.1f}"
                          + (f" {rows * pipe_per_row / q / threads:5.0%}" if rate else ""), flush=True)


def _pipe_rates() -> dict[str, float]:
    """The loop's rates, said; none where the kernel does not take the AVX2 path."""
    from fabric.compute.q8dot import kernel

    lib = kernel()
    if lib is None or lib.meshnet_q8dot_path() != 1:
        print("--pipe: this build does not take the AVX2 path; no pipe column")
        return {}
    rates = maddubs_rates()
    print(f"this core, 256-bit vpmaddubsw a second: {rates['int4'] / 1e9:.2f} G alone, {rates['int8'] / 1e9:.2f} G "
          "each widened by a vpmaddwd (pipe: int4 products against the first, int8 against the second)")
    return rates


if __name__ == "__main__":
    main()
