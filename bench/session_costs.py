#!/usr/bin/env python
"""What a request costs a node beside its tokens: finding its kept start, starting from kept KV,
ending. This checkout against another (``--other DIR``), each measurement in a process of its
own, alternated ``--rounds`` times; the medians and their ratios are printed.

    python bench/session_costs.py [--other DIR] [--rounds 3]

1. the head's prefix index: a request's match among 256 ended sessions that share a start of
   30 tokens (a chat template's system prompt), and of 3,000 (an agent's tools and documents),
   each followed by 40 or 1,000 ids of its own;
2. on the head's half of SmolLM2 (layers 0-16, int8, 2 threads): a pass of one decode step
   with seven prompts that continue kept KV all but their last token (a burst of requests that
   repeat a prompt: `bench/concurrency.py`'s waves), then their ends (the KV kept for reuse),
   and the end of a session of 2,000 positions that decoded in the batch group.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MATCH = """
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from fabric.node.prefixes import PrefixIndex
from fabric.wire.protocol import Hop
route = (Hop("n1", "tcp://a:1", 0, 15), Hop("n2", "tcp://b:1", 16, 29))
rng, out = random.Random(1), {}
for shared, own in ((30, 40), (3000, 1000)):
    index, start = PrefixIndex(), [rng.randrange(50000) for _ in range(shared)]
    for i in range(256):
        index.add(f"s{i}", start + [rng.randrange(50000) for _ in range(own)], route)
    ask = start + [rng.randrange(50000) for _ in range(own)]
    began = time.perf_counter()
    for _ in range(20):
        index.match(ask, route)
    out[f"match, 256 sharing {shared}"] = (time.perf_counter() - began) / 20 * 1e3
print(json.dumps(out))
"""

BURST = """
import json, statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
from fabric.compute.executor import Chunk, ShardExecutor, Step
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.wire.shard import Shard
torch.set_num_threads(2)
ex = ShardExecutor(load_shard(resolve("smollm2-135m"), Shard(0, 16, 30), progress=False, quant="int8"),
                   KVStore(retain_bytes=1 << 30))
prompt, pos, mixed, ends = list(range(100, 136)), 20, [], []
ex.run("kept", 0, 16, torch.tensor([prompt]), 0)
ex.retain("kept")
ex.run("d", 0, 16, torch.tensor([prompt[:20]]), 0)
for k in range(12):
    chunks = [Chunk(Step(f"s{k}.{j}", 0, 16, torch.tensor([[prompt[-1]]]), 35), reuse="kept") for j in range(7)]
    began = time.perf_counter()
    ex.run_mixed([Step("d", 0, 16, torch.tensor([[5]]), pos)], chunks)
    mixed.append(time.perf_counter() - began)
    steps = [Step("d", 0, 16, torch.tensor([[5]]), pos + 1)] + [Step(c.step.session, 0, 16, torch.tensor([[5]]), 36)
                                                                for c in chunks]
    ex.run_batch(steps)
    pos += 2
    began = time.perf_counter()
    for c in chunks:
        ex.retain(c.step.session)
    ends.append(time.perf_counter() - began)
long, ids = [], [(7 * i * i + 3 * i) % 40000 + 10 for i in range(2000)]
for k in range(4):  # a long chat's end: its row of the batch group kept for reuse
    for name in ("a", "b"):
        ex.run(f"{name}{k}", 0, 16, torch.tensor([ids]), 0)
    ex.run_batch([Step(f"{name}{k}", 0, 16, torch.tensor([[5]]), 2000) for name in ("a", "b")])
    began = time.perf_counter()
    ex.retain(f"a{k}")
    long.append(time.perf_counter() - began)
    ex.retain(f"b{k}")
print(json.dumps({"pass: 1 decode step + 7 prompts after kept KV": statistics.median(mixed[2:]) * 1e3,
                  "7 sessions' ends": statistics.median(ends[2:]) * 1e3,
                  "a 2,000-position session's end": statistics.median(long[1:]) * 1e3}))
"""


def measure(checkout: Path, script: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", script, str(checkout)], capture_output=True, text=True, check=True,
                         cwd=checkout, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "2", "HOME": str(Path.home())}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", default=None, metavar="DIR", help="another checkout to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    builds = {"this checkout": REPO} | ({args.other: Path(args.other)} if args.other else {})
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    for _ in range(args.rounds):
        for name, checkout in builds.items():
            for script in (MATCH, BURST):
                for what, ms in measure(checkout, script).items():
                    runs[name].setdefault(what, []).append(ms)
    mine = runs["this checkout"]
    for what in mine:
        line = f"{what}: {statistics.median(mine[what]):.2f} ms"
        if args.other:
            theirs = statistics.median(runs[args.other][what])
            line += f"; {args.other}: {theirs:.2f} ms ({statistics.median(mine[what]) / theirs:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
