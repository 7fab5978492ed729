#!/usr/bin/env python
"""Decode-step time of one forward pass under OpenMP wait policies, in one run.

    python bench/omp_wait.py [--rounds 3] [--threads 2]

Each setting runs in a fresh process (libgomp reads its environment when torch loads):
a 15-layer random llama of SmolLM2's width, 60 single-token decode steps after a 40-token
prompt; prints ms per step for each round. Settings: the libgomp default (idle workers
spin ~300 000 times), OMP_WAIT_POLICY=PASSIVE (sleep at once) and GOMP_SPINCOUNT=N.
Run it once on a quiet machine and once beside a busy process to see why ``meshnet node``
sets GOMP_SPINCOUNT=10000.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

STEP = r"""
import sys, time, torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=15, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
torch.set_num_threads(int(sys.argv[1]))
with torch.inference_mode():
    cache = DynamicCache()
    model(torch.randint(0, 1000, (1, 40)), cache=cache, use_cache=True)
    t = time.perf_counter()
    for _ in range(60):
        model(torch.tensor([[5]]), cache=cache, use_cache=True)
    print((time.perf_counter() - t) / 60 * 1000)
"""
SETTINGS = {"default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin 2000": {"GOMP_SPINCOUNT": "2000"},
            "spin 10000": {"GOMP_SPINCOUNT": "10000"}, "spin 50000": {"GOMP_SPINCOUNT": "50000"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    results: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):  # rounds interleave the settings, so drift hits all alike
        for name, env in SETTINGS.items():
            out = subprocess.run([sys.executable, "-c", STEP, str(args.threads)], env={**base, **env},
                                 capture_output=True, text=True, check=True).stdout
            results[name].append(float(out.strip().splitlines()[-1]))
    print(f"ms per decode step, {args.threads} threads, {args.rounds} rounds")
    for name, ms in results.items():
        print(f"  {name:<11} " + "  ".join(f"{x:6.1f}" for x in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
