#!/usr/bin/env python
"""Aggregate decode throughput against concurrent streams, as ratios measured in one run.

    python bench/concurrency.py [--model smollm2-135m] [--streams 1,2,4,8] [--tokens 48] [--reps 3]
                                [--plot OUT.png] [--device cpu|cuda] [--dtype float32|bfloat16]
                                [--node-args "--kv-cache-gib 0"] [--avx2]

Starts a tracker and a 2-node split (``python -m fabric.cli ...``, as ``meshnet up`` does:
all cores each and one compute lock) and drives it with N concurrent ``fabric.Client``
streams (greedy, distinct prompts, each exactly ``--tokens`` long), timing aggregate
generated tokens per second over the whole wave. Baselines measured in the same run: one
stream on the same cluster, and single-process transformers generating the same 8 prompts
as one padded batch (``generate`` with batch 8, all cores). Targets: 8 streams >= 4x one
stream, and >= 0.9x the single-process batch of 8. Writes a PNG plot when matplotlib is
installed.

The machine's speed drifts (by a third within minutes on a shared host), so one baseline
against waves run minutes later compares two machines. Each of ``--reps`` rounds therefore
times the baseline and then every stream count back to back, and each ratio is the median
of the rounds' own ratios (tok/s figures: the median over rounds). Beside each round: the
share of the CPU that other tenants used while it ran.

Every wave sends the same prompts, so with the nodes' default KV cache a wave's requests
start from the KV that the previous wave's kept (only the last prompt token is computed);
``--node-args "--kv-cache-gib 0"`` measures them prefilled in full, as the baseline does.

``--avx2`` runs everything, nodes and baseline, on the code an AVX2-only CPU runs: torch's
AVX2 kernels (``ATEN_CPU_CAPABILITY``, oneDNN's and MKL's instruction limits) and meshnet's C
kernels built for ``x86-64-v3`` (``MESHNET_NATIVE_ARCH``). The memory system and the clock stay
this machine's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "MESHNET_NATIVE_ARCH": "x86-64-v3"}
if __name__ == "__main__" and "--avx2" in sys.argv and any(os.environ.get(k) != v for k, v in AVX2.items()):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2})  # before torch loads

from fabric import Client
from fabric.compute.models import resolve
from fabric.wire.shard import even_split
from fabric.cli.supervision import stop_processes
from tests.cluster import free_port  # noqa: E402
from tests.support import wait_for

PROMPTS = ["Why is the sky blue?", "Name three prime numbers.", "Write a haiku about rivers.",
           "What is a transformer model?", "Describe a cat in one sentence.", "What is 12 times 12?",
           "Give me a synonym for happy.", "Where is the Eiffel Tower?"]


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and the nodes' ``--quant``."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where nodes and the baseline compute (default %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype of nodes and baseline (default %(default)s)")
    parser.add_argument("--quant", default="none", choices=["auto", "none", "int8", "int4"],
                        help="the nodes' --quant (default %(default)s: every layer in --dtype, the weights the "
                             "transformers baseline computes with; `meshnet node` itself defaults to auto)")


def device_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The node flags for ``add_device_args``' choices."""
    return ("--device", args.device, "--dtype", args.dtype, "--quant", args.quant)


def up_split(model: str, node_args: tuple[str, ...] | list[str], nodes: int) -> list:
    """The shards `meshnet up` gives ``nodes`` nodes run with ``node_args`` (``up_command.up_shards``:
    balanced by what each holds, so the tail, which holds the lm_head, takes fewer layers)."""
    from fabric.cli.up_command import up_shards

    _, dtype, quant = _as_up(model, node_args)
    return up_shards(model, nodes, dtype, quant)


def _as_up(model: str, node_args: tuple[str, ...] | list[str]) -> tuple[str, str, str]:
    """(device, dtype, quant) of nodes run with ``node_args`` (their last of each flag, else the
    defaults), the quantization resolved as `meshnet up` resolves it."""
    from fabric.cli.memory_plan import picked_quant

    def last(flag: str, default: str) -> str:
        at = max((i for i, a in enumerate(node_args) if a == flag), default=-1)
        return node_args[at + 1] if 0 <= at < len(node_args) - 1 else default

    device = last("--device", "cpu")
    return device, last("--dtype", "float32"), picked_quant(last("--quant", "auto"), model, device)


def start_cluster(model: str, nodes: int, tmp: Path, threads: int = 0,
                  node_args: tuple[str, ...] = (), shards: list | None = None,
                  ready_s: float = 300) -> tuple[list[subprocess.Popen], str]:
    """A tracker and ``nodes`` nodes of ``model``, routable within ``ready_s`` seconds; split as
    ``shards`` says, else as `meshnet up` splits (evenly where ``threads`` is given)."""
    tracker = f"tcp://127.0.0.1:{free_port()}"
    me = [sys.executable, "-m", "fabric.cli", "--log-level", "warning"]
    # default: all cores, and decode passes at once where quantized, as `meshnet up`
    threads_args = ["--threads", str(threads)] if threads else []
    procs = [subprocess.Popen([*me, "tracker", "--bind", tracker, "--pub", f"tcp://127.0.0.1:{free_port()}",
                               "--db", str(tmp / "ledger.sqlite3")], cwd=REPO)]
    from fabric.compute.models import load_config

    layers = load_config(resolve(model)).num_hidden_layers
    shards = shards or (even_split(layers, nodes) if threads else up_split(model, node_args, nodes))
    for shard in shards:
        procs.append(subprocess.Popen([*me, "node", "--model", model, "--layers", str(shard), "--tracker",
                                       tracker, *threads_args, "--compute-lock", str(tmp / "compute.lock"),
                                       "--no-progress", *node_args], cwd=REPO))
    with Client(tracker, timeout=2) as client:
        def ready():
            try:
                status = client.status()
            except Exception:
                return False
            return len(status["nodes"]) == nodes and any(status["plans"].values())
        if not wait_for(ready, ready_s, 0.5):
            raise SystemExit("the cluster did not come up")
    return procs, tracker


def wave(tracker: str, model: str, streams: int, tokens: int,
         firsts: list[float] | None = None, temperature: float = 0.0) -> tuple[float, list[list[int]]]:
    """Aggregate tok/s of ``streams`` concurrent generations (greedy; sampled at ``temperature``
    with a seed per stream where it is above 0), and their token ids; each stream's seconds
    from the wave's start to its first token are added to ``firsts``."""
    outputs: list[list[int]] = [[] for _ in range(streams)]
    began = time.perf_counter()

    def one(i: int) -> None:
        with Client(tracker, timeout=120) as client:
            # every stream generates exactly ``tokens``, as the baseline's min_new_tokens makes it
            for event in client.generate(model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                         max_tokens=tokens, ignore_eos=True, temperature=temperature,
                                         seed=i if temperature else None):
                if event.token_ids and not outputs[i] and firsts is not None:
                    firsts.append(time.perf_counter() - began)
                outputs[i].extend(event.token_ids)

    elapsed = at_once(one, streams)
    return sum(len(o) for o in outputs) / elapsed, outputs


def at_once(one, streams: int) -> float:
    """Seconds for ``one(0) .. one(streams - 1)``, each in its own thread, all started together."""
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


class Batch8:
    """Single-process transformers: the same prompts as one left-padded batch, loaded once
    and timed as often as asked."""

    def __init__(self, model: str, batch: int, tokens: int, dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        from fabric.compute.models import load_tokenizer

        source = resolve(model)
        tok = load_tokenizer(source)
        tok.padding_side = "left"
        tok.pad_token = tok.pad_token or tok.eos_token
        self.lm = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                                       dtype=getattr(torch, dtype)).to(device).eval()
        texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                         add_generation_prompt=True, tokenize=False) for i in range(batch)]
        self.enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        self.batch, self.tokens = batch, tokens
        self.generate(4)  # warm up

    def generate(self, tokens: int):
        import torch

        with torch.inference_mode():
            return self.lm.generate(**self.enc, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)

    def measure(self) -> float:
        """Aggregate tok/s of one batched generation."""
        start = time.perf_counter()
        out = self.generate(self.tokens)
        elapsed = time.perf_counter() - start
        return (out.shape[1] - self.enc["input_ids"].shape[1]) * self.batch / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3, help="rounds of baseline + every stream count")
    parser.add_argument("--plot", default=None, help="write a PNG of aggregate tok/s against streams")
    parser.add_argument("--node-args", default="", help="more flags for every node, in one string")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per node (default: all cores, as `meshnet up`)")
    add_device_args(parser)
    parser.add_argument("--avx2", action="store_true", help="torch's and meshnet's AVX2 code paths only, as on "
                        "an AVX2-only CPU (set before torch loads: the script starts itself again)")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    from bench.fabric_bench import (
        LoadMeter,  # here: fabric_bench imports this module's device flags
    )

    baseline = Batch8(args.model, 8, args.tokens, args.dtype, args.device)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        procs, tracker = start_cluster(args.model, 2, Path(tmp), args.threads,
                                       (*args.node_args.split(), *device_args(args)))
        try:
            model_id = resolve(args.model).model_id  # what clients ask for (a directory's name)
            for n in counts:  # warm up every batch size: first shapes cost extra (on a GPU, seconds)
                wave(tracker, model_id, n, 4)
            for _ in range(args.reps):
                with LoadMeter() as meter:
                    row = {"baseline": baseline.measure()}
                    row.update({n: wave(tracker, model_id, n, args.tokens)[0] for n in counts})
                rounds.append({**row, "foreign": meter.foreign})
        finally:
            stop_processes(procs, grace=30)
    report(args, counts, rounds)
    return 0


def report(args, counts: list[int], rounds: list[dict]) -> None:
    one = counts[0]
    results = {n: median([r[n] for r in rounds]) for n in counts}
    baseline = median([r["baseline"] for r in rounds])
    vs_one = {n: median([r[n] / r[one] for r in rounds]) for n in counts}
    vs_base = {n: median([r[n] / r["baseline"] for r in rounds]) for n in counts}
    print(f"concurrency on a 2-node split of {args.model} ({args.dtype} on {args.device}), "
          f"{args.tokens} tokens per stream, median of {len(rounds)} round(s)"
          + (f", nodes with {args.node_args}" if args.node_args else ""))
    import torch

    print(f"  torch's CPU kernels: {torch.backends.cpu.get_cpu_capability()}; meshnet's C kernels built for "
          f"-march={os.environ.get('MESHNET_NATIVE_ARCH') or 'native'}")
    for i, r in enumerate(rounds, 1):
        waves = ", ".join(f"{n}: {r[n]:.1f}" for n in counts)
        print(f"  round {i}: batch-8 {r['baseline']:.1f} tok/s; streams {waves}; "
              f"other tenants {100 * r['foreign']:.0f}% of the CPU")
    print(f"  single-process transformers, batch of 8: {baseline:.1f} tok/s aggregate")
    for n in counts:
        print(f"  {n} stream(s): {results[n]:6.1f} tok/s aggregate  = {vs_one[n]:.2f}x {one} stream(s), "
              f"{vs_base[n]:.2f}x transformers batch-8")
    if 8 in results:
        ok = vs_one[8] >= 4 and vs_base[8] >= 0.9
        print(f"  target 8 streams >= 4x one and >= 0.9x batch-8: {'PASS' if ok else 'MISS'}")
    if args.plot:
        plot(args.plot, counts, results, baseline)


def plot(path: str, counts: list[int], results: dict[int, float], baseline: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no plot: pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(counts, [results[n] for n in counts], marker="o", label="meshnet, 2-node split")
    ax.axhline(baseline, linestyle="--", color="gray", label="transformers, batch of 8, one process")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"  plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
