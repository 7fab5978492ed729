#!/usr/bin/env python
"""Resident memory of a node holding half of a model against one holding all of it.

    python bench/memory.py [--model smollm2-135m] [--dtype float32|bfloat16] [--tokens 8] [--large]

Runs one cluster at a time, so a large model fits: first a tracker and one node with every
layer, then a tracker and two nodes with half each (``python -m fabric.cli node``, as
``meshnet up`` starts them). Each node's RSS and USS (psutil) are read after it has loaded
and again after one greedy generation of ``--tokens`` tokens through the cluster. Also
measured: the runtime floor, the RSS of a Python that imported what a node imports and
loaded no weights. Target: each half-model node <= 0.6x the full node's RSS.

A small model is mostly floor (SmolLM2-135M in float32: 390 MiB of ~970). ``--large``
measures, after ``--model``, a stand-in of SmolLM2-1.7B's shape too: SmolLM2's config
resized, its tokenizer, random bfloat16 weights (``bench/stand_in.py``; 3.4 GB written to a
temporary directory and removed after), computed in ``--dtype``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from concurrency import start_cluster  # noqa: E402
from fabric_bench import memory, runtime_floor  # noqa: E402

from fabric import Client
from fabric.compute.models import load_config, resolve
from fabric.wire.shard import even_split
from fabric.cli.supervision import stop_processes

TARGET = 0.6
MIB = 2**20


def measure(model: str, nodes: int, dtype: str, tokens: int) -> list[dict]:
    """Per node of an even ``nodes``-way split: layers, RSS/USS after load and after a generation."""
    layers = load_config(resolve(model)).num_hidden_layers
    with tempfile.TemporaryDirectory() as tmp:
        procs, tracker = start_cluster(model, nodes, Path(tmp), node_args=("--dtype", dtype, "--quant", "none"))
        try:
            node_procs = procs[1:]
            rows = [{"layers": str(shard), "load": memory(p)}
                    for shard, p in zip(even_split(layers, nodes), node_procs)]
            with Client(tracker, timeout=600) as client:
                got = sum(len(e.token_ids) for e in client.generate(
                    resolve(model).model_id, messages=[{"role": "user", "content": "Why is the sky blue?"}],
                    max_tokens=tokens, ignore_eos=True))
            if got != tokens:
                raise SystemExit(f"the {nodes}-node cluster generated {got} tokens, not {tokens}")
            for row, p in zip(rows, node_procs):
                row["gen"] = memory(p)
            return rows
        finally:
            stop_processes(procs, grace=60)


LARGE = ("num_hidden_layers=24", "hidden_size=2048", "intermediate_size=8192", "num_attention_heads=32",
         "num_key_value_heads=32", "max_position_embeddings=8192")  # SmolLM2-1.7B's shape


def report(model: str, dtype: str, tokens: int, floor: int | None) -> None:
    """Measure ``model`` and print its table and verdict."""
    full = measure(model, 1, dtype, tokens)[0]
    halves = measure(model, 2, dtype, tokens)
    print(f"resident memory of nodes of {resolve(model).model_id} ({dtype}), MiB: RSS (USS) after load / after {tokens} tokens")
    for row in [full, *halves]:
        print(f"  layers {row['layers']:<8} {row['load'][0] / MIB:7.0f} ({row['load'][1] / MIB:5.0f}) / "
              f"{row['gen'][0] / MIB:7.0f} ({row['gen'][1] / MIB:5.0f})")
    if floor:
        print(f"  runtime floor (imports, no weights): {floor / MIB:.0f} MiB")
    worst = 0.0
    for half in halves:
        ratios = [half[k][0] / full[k][0] for k in ("load", "gen")]
        worst = max(worst, *ratios)
        above = (f"; above the floor {(half['gen'][0] - floor) / (full['gen'][0] - floor):.2f}x" if floor else "")
        print(f"  half {half['layers']} / full: {ratios[0]:.2f}x after load, {ratios[1]:.2f}x after a generation"
              + above)
    print(f"  target each half-model node <= {TARGET}x the full node: {'PASS' if worst <= TARGET else 'MISS'} "
          f"({worst:.2f}x, the larger half)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=8, help="tokens of the generation before the second reading")
    parser.add_argument("--large", action="store_true", help="also a stand-in of SmolLM2-1.7B's shape")
    args = parser.parse_args()

    floor = runtime_floor()
    report(args.model, args.dtype, args.tokens, floor)
    if args.large:
        with tempfile.TemporaryDirectory() as tmp:
            large = Path(tmp) / "smollm2-1.7b-shape"
            subprocess.run([sys.executable, str(REPO / "bench" / "stand_in.py"), str(large), "--model", "smollm2-135m",
                            "--weights", "--dtype", "bfloat16", "--set", *LARGE], check=True,
                           stdout=subprocess.DEVNULL)
            report(str(large), args.dtype, args.tokens, floor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
