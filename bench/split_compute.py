"""Is the split's extra compute meshnet's, or the machine's?

    python bench/split_compute.py [--model smollm2-135m] [--rounds 4] [--threads 1] [--tokens 40] [--pinned]

`bench/fabric_bench.py` finds two nodes computing more, per token, than one node does for the
same layers (compute only: hops, sockets and the loop not counted). This script takes the
fabric out: no nodes, no sockets, no scheduler, only the shard executors of exact mode
(float32, ``--quant none``) and one-token decode steps, timed around ``ShardExecutor.run``:

- **one process**: the whole model's executor, and the two halves' executors side by side,
  each half run right after the other;
- **two processes**: each half's executor in a process of its own, the token handed over a
  pipe, as two nodes on one machine take turns.

``--pinned`` adds two processes whose steps run on one CPU (as a node's one-thread pass
handed over runs on the CPU the last pass ran on, fabric/node/hops.py ``_warm_cpu``).

Rounds alternate them, so a busy machine's drift falls on all. It prints, per round and as
medians, the compute per token of each, and the two processes' over the one process's halves.
The same code runs in both: a ratio above 1 is what the machine charges for taking turns
between two processes (their caches, the idle core's wake-up), not the fabric.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT = 60  # tokens prefilled before the timed steps
SKIP = 5  # first steps not counted (warm-up)


def executor(model: str, start: int, end: int, threads: int):
    """An exact-mode executor of layers start..end (end -1: the last)."""
    import torch

    from fabric.compute.executor import ShardExecutor
    from fabric.compute.kv import KVStore
    from fabric.compute.models import load_config, load_shard, resolve
    from fabric.wire.shard import Shard

    torch.set_num_threads(threads)
    source = resolve(model)
    layers = load_config(source).num_hidden_layers
    end = layers - 1 if end < 0 else end
    return ShardExecutor(load_shard(source, Shard(start, end, layers), progress=False, quant=None), KVStore()), end


def prompt():
    import torch

    return torch.randint(100, 20000, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def step(ex, end: int, x, pos: int):
    """Run one step of ``ex``'s layers; (seconds, what the next stage takes)."""
    began = time.perf_counter()
    out = ex.run("s", ex.w.shard.start, end, x, pos)
    took = time.perf_counter() - began
    return took, out.hidden if out.hidden is not None else out.logits.argmax().view(1, 1)


def one_process(model: str, middle: int, threads: int, tokens: int) -> tuple[float, float]:
    """Medians, ms per token: (the whole model, its two halves one after the other)."""
    whole, last = executor(model, 0, -1, threads)
    head, _ = executor(model, 0, middle, threads)
    tail, _ = executor(model, middle + 1, -1, threads)
    ids = prompt()
    step(whole, last, ids, 0)
    step(tail, last, step(head, middle, ids, 0)[1], 0)
    wholes, halves = [], []
    for pos in range(PROMPT, PROMPT + tokens):
        wholes.append(step(whole, last, ids[:, :1], pos)[0])
        took_head, hidden = step(head, middle, ids[:, :1], pos)
        halves.append(took_head + step(tail, last, hidden, pos)[0])
    return 1e3 * statistics.median(wholes[SKIP:]), 1e3 * statistics.median(halves[SKIP:])


def _stage(model: str, start: int, end: int, threads: int, conn, cpu: int = -1) -> None:
    from fabric.compute.compute_lock import on_cpu

    ex, end = executor(model, start, end, threads)
    conn.send("ready")
    times = []
    while (job := conn.recv()) is not None:
        with on_cpu(cpu):
            took, out = step(ex, end, job[1], job[0])
        times.append(took)
        conn.send(out)
    conn.send(times)


def two_processes(model: str, middle: int, threads: int, tokens: int, cpu: int = -1) -> float:
    """Median ms per token of the halves computed in two processes taking turns; with ``cpu``,
    each step's thread pinned there for the step (as a node's one-thread pass handed over runs
    on the CPU the last pass ran on)."""
    ctx = multiprocessing.get_context("spawn")
    stages = []
    for start, end in ((0, middle), (middle + 1, -1)):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_stage, args=(model, start, end, threads, there, cpu), daemon=True)
        proc.start()
        stages.append((here, proc))
    try:
        for here, _ in stages:
            here.recv()
        ids = prompt()
        for pos, x in [(0, ids)] + [(p, ids[:, :1]) for p in range(PROMPT, PROMPT + tokens)]:
            for here, _ in stages:
                here.send((pos, x))
                x = here.recv()
        per_stage = []
        for here, _ in stages:
            here.send(None)
            per_stage.append(here.recv()[1:])  # the prompt's step not counted
        return 1e3 * statistics.median(a + b for a, b in list(zip(*per_stage))[SKIP:])
    finally:
        for _, proc in stages:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="threads of every executor (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=40, help="timed decode steps a round (default %(default)s)")
    ap.add_argument("--pinned", action="store_true",
                    help="also two processes whose steps run on one CPU, the lowest this process may use")
    args = ap.parse_args()
    from fabric.compute.models import load_config, resolve

    middle = load_config(resolve(args.model)).num_hidden_layers // 2 - 1
    print(f"split compute: {args.model}, exact mode, layers 0-{middle} | {middle + 1}-, {args.threads} thread(s), "
          f"{args.tokens} steps a round; ms per token of compute (medians)")
    ones, twos, pinned = [], [], []
    kinds = (0, 1, 2) if args.pinned else (0, 1)
    for r in range(args.rounds):
        for which in (kinds if r % 2 == 0 else kinds[::-1]):
            if which == 0:
                whole, halves = one_process(args.model, middle, args.threads, args.tokens)
                ones.append(halves)
                print(f"  round {r + 1}: one process: whole {whole:.1f}, halves {halves:.1f}", flush=True)
            elif which == 1:
                twos.append(two_processes(args.model, middle, args.threads, args.tokens))
                print(f"  round {r + 1}: two processes: halves {twos[-1]:.1f}", flush=True)
            else:
                pinned.append(two_processes(args.model, middle, args.threads, args.tokens, min(os.sched_getaffinity(0))))
                print(f"  round {r + 1}: two processes, one CPU: halves {pinned[-1]:.1f}", flush=True)
    one, two = statistics.median(ones), statistics.median(twos)
    print(f"halves in one process {one:.1f} ms, in two processes taking turns {two:.1f} ms: {two / one:.2f}x")
    if pinned:
        print(f"two processes taking turns on one CPU {statistics.median(pinned):.1f} ms: "
              f"{statistics.median(pinned) / one:.2f}x")


if __name__ == "__main__":
    main()
