#!/usr/bin/env python
"""What one decode step costs a node's compute alone: a one-token pass of the default mode.

    python bench/lean_pass.py [--model smollm2-135m] [--other DIR] [--rounds 3] [--steps 20] [--context 50]

Loads the model's default-mode executor (the file's own grid, bfloat16, the lean layers; all
layers and the lm_head in one shard, as ``meshnet up --nodes 1`` holds them), prefills
``--context`` tokens and times one-token steps on one thread: the median over 5 blocks of ``--steps``
steps, in ms a pass. No sockets, no sampling: the time a node's executor takes per token, which
is what the lean layers' operator count moves (docs/BENCHMARKS.md, *Fewer operators per layer*).

``--other DIR`` (another checkout, e.g. ``git worktree add /tmp/old HEAD~3``) alternates a
process of DIR's code with one of this checkout's, ``--rounds`` times, and prints each one's
median and this checkout's time over DIR's (below 1: faster). Each process loads its own copy
and the machine's speed drifts, so compare only figures alternated in one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 50  # prompt tokens before the timed steps, unless --context says
BLOCKS = 5  # timed blocks of --steps steps; their median is the figure


def measure(model: str, steps: int, context: int = CONTEXT) -> float:
    """ms a one-token pass, in this process (the code on sys.path[0])."""
    import torch

    from tests.test_invariant import default_mode

    torch.set_num_threads(1)
    ex = default_mode(model, cache_root=Path.home() / ".cache" / "meshnet")
    last = ex.w.shard.num_layers - 1
    ex.run("s", 0, last, torch.arange(10, 10 + context)[None], 0)
    at, blocks = context, []
    for block in range(BLOCKS + 1):  # the first warms up
        began = time.perf_counter()
        for _ in range(steps):
            ex.run("s", 0, last, torch.tensor([[7]]), at)
            at += 1
        if block:
            blocks.append((time.perf_counter() - began) / steps * 1e3)
    return statistics.median(blocks)


def in_process_of(repo: Path, model: str, steps: int, context: int) -> float:
    """``measure`` in a process of its own whose ``fabric`` and ``tests`` are ``repo``'s."""
    code = (f"import sys; sys.path.insert(0, {str(repo)!r}); sys.path.insert(1, {str(REPO / 'bench')!r}); "
            f"import lean_pass, json; print(json.dumps(lean_pass.measure({model!r}, {steps}, {context})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{repo}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model id, alias or GGUF path (default: %(default)s)")
    ap.add_argument("--other", default=None, metavar="DIR", help="another checkout to alternate with this one")
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --other (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="one-token steps a timed block (default: %(default)s)")
    ap.add_argument("--context", type=int, default=CONTEXT, help="prompt tokens before the timed steps (default: %(default)s)")
    args = ap.parse_args()
    if args.other is None:
        print(f"one-token pass, one thread: {in_process_of(REPO, args.model, args.steps, args.context):.1f} ms")
        return
    other, mine = [], []
    for r in range(args.rounds):
        other.append(in_process_of(Path(args.other).resolve(), args.model, args.steps, args.context))
        mine.append(in_process_of(REPO, args.model, args.steps, args.context))
        print(f"round {r + 1}: {args.other} {other[-1]:.1f} ms, this checkout {mine[-1]:.1f} ms")
    a, b = statistics.median(mine), statistics.median(other)
    print(f"median: this checkout {a:.1f} ms a pass, {args.other} {b:.1f} ms: {a / b:.2f}x the time "
          f"({b / a:.2f}x the speed)")


if __name__ == "__main__":
    main()
