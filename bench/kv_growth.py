#!/usr/bin/env python
"""What a batch group's growth costs the decode steps of its sessions, and what its buffers keep resident.

    python bench/kv_growth.py [--shape smollm2|1.7b] [--positions 100,1000] [--sessions 1,2]
                              [--steps 2000] [--own] [--reps 3] [--other DIR]

Sessions decoding together keep their KV in the rows of one buffer (``fabric.compute.rows.RowGroup``);
when a row is full, the next step rebuilds the buffer with more columns and copies the rows over,
which stalls that step of every session in it. A stream decoding alone keeps a buffer per layer
(``fabric.compute.cache.GrowingLayer``, ``--own``), grown the same way. Each measurement runs in a
fresh process (a heap with nothing freed in it, as after a node's idle trim): ``--sessions``
sessions of ``--positions`` positions (a prompt) of the model's shape (``smollm2``: 30 layers x 3
KV heads x 64; ``1.7b``: 24 x 32 x 64, bfloat16), then ``--steps`` decode steps make room for a
position and write one for each session, as a pass does (no layers are computed). Printed: the
growths, the time they stalled their steps (in all, and the longest), the page faults, and the
memory held resident at the end against the buffers' size. ``--other DIR`` runs another
checkout the same way, alternated measurement by measurement, with the ratio of the stalls'
medians. No
sockets, no model weights.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = {"smollm2": (30, 3, 64), "1.7b": (24, 32, 64)}

ONE = r"""
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from fabric.compute.cache import GrowingLayer
from fabric.compute.heap import release_freed_memory
from fabric.compute.rows import RowGroup
layers, heads, dim, positions, sessions, steps = map(int, sys.argv[2:8])
own = sys.argv[8] == "own"
torch.set_num_threads(2)
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
keys = torch.randn(1, heads, positions, dim).to(torch.bfloat16)
one = keys[:, :, :1].clone()
before = resident()
if own:  # each session's own cache: a buffer per layer, as a stream decoding alone keeps it
    every = [GrowingLayer() for _ in range(sessions * layers)]  # every session's layers, one after another
    for layer in every:
        layer.update(keys, keys)  # the prompt
    buffers = lambda: [layer._keys.data_ptr() for layer in every]
    def step():
        for layer in every:
            layer.make_room(1)
    def write():
        for layer in every:
            layer.update(one, one)
    held = lambda: sum(layer._keys.numel() + layer._values.numel() for layer in every) * 2
else:  # a batch group's rows
    group = RowGroup(0, layers - 1)
    for s in range(sessions):
        group.join(f"s{s}", {i: (keys, keys) for i in range(layers)})
    rows = list(range(sessions))
    buffers = lambda: group.kv.data_ptr()
    step = lambda: group.step_cache(0, sessions)
    def write():
        group.kv[:, :, rows, :, int(group.lengths[0])] = 1
        group.advance(rows)
    held = lambda: group.kv.numel() * group.kv.element_size()
release_freed_memory()
stalls, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(steps):  # what a decode step does to the buffers: room for a position, then one written
    was, began = buffers(), time.perf_counter()
    step()
    if buffers() != was:
        stalls.append(time.perf_counter() - began)
    write()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"stalls": stalls, "faults": faults, "resident": resident() - before, "buffer": held()}))
"""


def measure(checkout: Path, shape: tuple[int, int, int], positions: int, sessions: int, steps: int,
            kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE, str(checkout), *map(str, shape), str(positions), str(sessions),
                          str(steps), kind],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--positions", default="100,1000", help="positions each session holds (comma-separated)")
    ap.add_argument("--sessions", default="1,2", help="sessions in the group (comma-separated)")
    ap.add_argument("--steps", type=int, default=2000, help="decode steps after the sessions join")
    ap.add_argument("--own", action="store_true", help="each session's own cache (a stream alone), not a group")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--other", metavar="DIR", help="another checkout, alternated measurement by measurement")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    checkouts = [("this", REPO)] + ([("other", Path(args.other).resolve())] if args.other else [])
    print(f"shape {args.shape}: {shape[0]} layers x {shape[1]} KV heads x {shape[2]}, bfloat16; "
          f"{'each session its own cache' if args.own else 'a batch group'}")
    for positions in map(int, args.positions.split(",")):
        for sessions in map(int, args.sessions.split(",")):
            runs = {name: [] for name, _ in checkouts}
            for _ in range(args.reps):
                for name, checkout in checkouts:
                    runs[name].append(measure(checkout, shape, positions, sessions, args.steps,
                                               "own" if args.own else "group"))
            medians = {}
            for name, got in runs.items():
                medians[name] = statistics.median(sum(r["stalls"]) for r in got)
                last, each = got[-1], ", ".join(f"{sum(r['stalls']) * 1e3:.0f}" for r in got)
                print(f"  {sessions} session(s) of {positions} positions, {args.steps} steps, {name}: "
                      f"{len(last['stalls'])} growth(s), {medians[name] * 1e3:.0f} ms of stalls in all "
                      f"(runs {each}; the longest {max(last['stalls'], default=0) * 1e3:.0f} ms), "
                      f"{last['faults']} page faults, resident {last['resident'] / 2**20:.0f} MiB "
                      f"of a {last['buffer'] / 2**20:.0f} MiB buffer")
            if args.other:
                print(f"    this / other, stalls: {medians['this'] / max(medians['other'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
