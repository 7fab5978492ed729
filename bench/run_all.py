#!/usr/bin/env python
"""Every benchmark figure of docs/BENCHMARKS.md in one run.

    python bench/run_all.py [--out bench/results/all] [--quick] [--only NAME ...]
                            [--model REF] [--device cpu|cuda] [--dtype float32|bfloat16]
                            [--quant none|auto|int8|int4]

Runs each script of ``bench/`` in turn (one at a time: they would disturb each other's
timings), as a subprocess with its own baselines measured in the same run, keeps each
one's full output in ``OUT/NAME.txt`` (and JSON where the script writes it), and ends with
every verdict line (PASS / MISS / met / missed) gathered in one summary. A script that
fails is reported and the rest still run. A full run takes about an hour on 2 cores;
``--quick`` runs shorter versions (fewer tokens and repetitions) in about 20 minutes.
``--model``, ``--device``, ``--dtype`` and the nodes' ``--quant`` (default none: the weights
the transformers baselines compute with) go to the scripts that take them; with ``--device
cuda`` only those run (the others measure CPU kernels, threads and networks).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from concurrency import add_device_args, device_args  # noqa: E402

# name -> (arguments for a full run, arguments for --quick); OUT is replaced by the output folder
SCRIPTS = {
    "fabric_bench": (["--json", "OUT/fabric_bench.json"], ["--quick", "--json", "OUT/fabric_bench.json"]),
    "concurrency": (["--plot", "OUT/concurrency.png"], ["--streams", "1,8", "--tokens", "32", "--reps", "2",
                                                         "--plot", "OUT/concurrency.png"]),
    "prefill_itl": ([], ["--prompt-tokens", "1000", "--decode-tokens", "250"]),
    "batch_step": ([], ["--steps", "20"]),
    "long_context": ([], ["--reps", "1", "--turns", "3", "--prompt-tokens", "1000", "--concurrency-reps", "1",
                          "--speed-rounds", "2", "--speed-prompts", "4", "--speed-tokens", "32"]),
    # the default mode's failover (its speed is long_context's): how often a failover changes the text
    "default_mode": (["--parts", "failover"], ["--parts", "failover", "--failover-trials", "20",
                                                "--control-trials", "0", "--failover-tokens", "32"]),
    "quant_bench": (["--json", "OUT/quant_bench.json"], ["--reps", "2", "--json", "OUT/quant_bench.json"]),
    "failover": ([], ["--runs", "1"]),
    "audit": ([], ["--rounds", "2", "--clients", "2", "--trials", "1"]),
    # a stream's longest gap while its node replays a long audit (in slices, between its decode steps)
    "replay_itl": ([], ["--rounds", "1", "--positions", "1000"]),
    # what a request costs beside its tokens: the prefix index's match, a burst of prompts after kept KV, ends
    "session_costs": ([], ["--rounds", "1"]),
    # heads, tails and the tracker stopped and restarted under load: failed requests (target 0), identical answers
    "chaos": (["--json", "OUT/chaos.json"], ["--minutes", "1.5", "--clients", "2", "--json", "OUT/chaos.json"]),
    # two nodes started by hand: their default compute lock against none, and a 3,200-token prompt answered
    "standalone_nodes": (["--rounds", "2", "--node-args", "", "--node-args", "--compute-lock none"],
                         ["--prompts", "786,3200", "--node-args", "", "--node-args", "--compute-lock none"]),
    "load": (["--clients", "8", "--seconds", "30"], ["--clients", "4", "--seconds", "10"]),
    "omp_wait": ([], ["--rounds", "1"]),
    # the compute lock waited for off the node's loop: its cost per hop and per hand-off against the blocking path
    "lock_wait": ([], ["--rounds", "2", "--handoffs", "100"]),
    "memory": (["--large"], ["--large"]),
    "netbed": (["--json", "OUT/netbed.json"], ["--reps", "2", "--only", "2ms", "--json", "OUT/netbed.json"]),
    # one stream with drafts against without, copy-heavy and open prompts, loopback and a 30 ms round trip
    "speculative": (["--json", "OUT/speculative.json"], ["--reps", "1", "--tokens", "64", "--json",
                                                          "OUT/speculative.json"]),
}
DEVICE_AWARE = ("fabric_bench", "concurrency", "prefill_itl", "long_context")  # take --model, --device, --dtype, --quant
VERDICT = re.compile(r"\b(PASS|MISS|met|missed|MISSED|skipped)\b|\d+(\.\d+)?x\b")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "all"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="shorter runs of every script")
    parser.add_argument("--only", nargs="+", choices=list(SCRIPTS), help="run just these scripts")
    parser.add_argument("--model", default=None, help="model reference for the scripts that take one")
    add_device_args(parser)
    args = parser.parse_args()
    only = args.only or (DEVICE_AWARE if args.device != "cpu" else list(SCRIPTS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # scripts run in the repository: a folder inside it is named relatively, so outputs name no local paths
    where = str(out.resolve().relative_to(REPO)) if out.resolve().is_relative_to(REPO) else str(out)
    summary: list[str] = []
    for name, (full, quick) in SCRIPTS.items():
        if name not in only:
            continue
        argv = [a.replace("OUT", where) for a in (quick if args.quick else full)]
        if name in DEVICE_AWARE:
            argv += [*device_args(args), *(["--model", args.model] if args.model else [])]
        log = out / f"{name}.txt"
        print(f"== {name}: python bench/{name}.py {' '.join(argv)}  (output in {log})", flush=True)
        started = time.monotonic()
        with open(log, "w") as f:
            code = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), *argv], cwd=REPO,
                                  stdout=f, stderr=subprocess.STDOUT).returncode
        lines = log.read_text(errors="replace").splitlines()
        verdicts = [line.strip() for line in lines if VERDICT.search(line) and not line.startswith("[")]
        status = "ok" if code == 0 else f"FAILED (exit {code}; see {log})"
        summary.append(f"{name} ({time.monotonic() - started:.0f} s, {status})")
        summary += [f"    {line}" for line in verdicts[-12:]]
        print("\n".join(summary[-1 - len(verdicts[-12:]):]), flush=True)
    print("\n== summary\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
