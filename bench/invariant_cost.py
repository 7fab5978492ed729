"""What the batch-invariant default mode costs: this build against another, alternated in one run.

Each round runs, for each build, a fresh process that loads the whole model in the default
mode (``--quant auto``, one executor, no sockets), prefills a prompt of each length and
times ``--tokens`` greedy one-token steps after it, and the prefill itself. The builds
alternate within every round, so a busy neighbour slows both alike. Prints tokens/s per
build and the ratio of this build to the other (the median over rounds).

    git worktree add /tmp/before <commit before the change>
    python bench/invariant_cost.py --other /tmp/before --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, sys, time, torch
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_config, load_shard, pick_quant, resolve
from fabric.wire.shard import Shard
model, lengths, tokens = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
source = resolve(model)
layers = load_config(source).num_hidden_layers
scheme, _ = pick_quant("auto", source)
ex = ShardExecutor(load_shard(source, Shard(0, layers - 1, layers), progress=False, quant=scheme), KVStore())
last = layers - 1
out = {}
for n in lengths:
    ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(n))
    ex.run("warm", 0, last, ids[:, :8], 0)
    t = time.perf_counter()
    for at in range(0, n, 256):
        logits = ex.run(f"s{n}", 0, last, ids[:, at:at + 256], at).logits
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    for pos in range(n, n + tokens):
        logits = ex.run(f"s{n}", 0, last, logits.argmax().view(1, 1), pos).logits
    out[n] = {"decode_tok_s": tokens / (time.perf_counter() - t), "prefill_s": prefill}
print(json.dumps(out))
"""


def measure(build: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(build))
    out = subprocess.run([sys.executable, "-c", PROBE, args.model, args.lengths, str(args.tokens)], env=env,
                         cwd=build, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="a checkout of the build to compare against")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="100,1000,2000", help="prompt lengths (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per length (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    builds = {"this": REPO, "other": args.other}
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for name in order:
            runs[name].append(measure(builds[name], args))
            print(f"round {r + 1} {name}: " + ", ".join(f"{n}: {v['decode_tok_s']:.1f} tok/s, prefill "
                                                         f"{v['prefill_s']:.2f} s" for n, v in runs[name][-1].items()),
                  flush=True)
    print(f"{args.model}, default mode, this build ({REPO}) against {args.other}, {args.rounds} rounds alternated:")
    for n in args.lengths.split(","):
        decode = [a[n]["decode_tok_s"] / b[n]["decode_tok_s"] for a, b in zip(runs["this"], runs["other"])]
        prefill = [b[n]["prefill_s"] / a[n]["prefill_s"] for a, b in zip(runs["this"], runs["other"])]
        print(f"  prompt {n:>5}: decode {statistics.median(decode):.3f}x, prefill speed "
              f"{statistics.median(prefill):.3f}x (median of the rounds' ratios; above 1: this build is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
