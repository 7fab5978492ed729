"""Two or more builds or settings of `meshnet up`'s 2-node split, their waves alternated.

    python bench/ab_waves.py old@/tmp/old new                 # another checkout against this one
    python bench/ab_waves.py P S10:GOMP_SPINCOUNT=10000       # an environment variable
    python bench/ab_waves.py t1:--threads=1 auto --reps 6     # a node flag
    python bench/ab_waves.py old@/tmp/old new --temperature 1 # sampled, at OpenAI's default temperature
    python bench/ab_waves.py up h15:layers=15                 # the head's layer count
    python bench/ab_waves.py one:machines two:machines,--decode-threads=0   # a core and a lock per node

Each argument is a cluster: ``NAME[@CHECKOUT][:SETTING,...]``, a SETTING being ``VAR=value`` in
its processes' environment, ``--flag[=value]`` for its nodes, ``layers=N`` for a head of N
layers (the tail takes the rest; default `meshnet up`'s split), or ``machines``: each node
pinned to a core of its own with a compute lock of its own, as nodes on two machines run; ``@CHECKOUT`` runs another
checkout's code (``git worktree add /tmp/old HEAD~3``, or ``git archive REV | tar -x -C DIR``).
Every cluster is started as `meshnet up` starts its nodes (no ``--threads``, the default
``--quant auto``) and kept up; then, ``--reps`` times, each runs a wave of 1 and of 8 concurrent
greedy streams (``bench/concurrency.py``'s), the clusters' order reversed every other rep, so
a machine's drift falls on all alike. Printed: tok/s of every wave, then medians, the CPU
milliseconds the nodes spent per token, when the wave's last stream had its first token (how
long a burst of requests takes to settle), and 8 streams against 1. ``--trace`` runs the nodes
under ``bench/trace_node.py`` and adds each node's median pass time per batch size.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import concurrency  # noqa: E402
import fabric_bench as fb  # noqa: E402


def parse(spec: str) -> tuple[str, str, dict[str, str], list[str], int, bool]:
    """NAME[@CHECKOUT][:SETTING,...] -> (name, checkout, environment, node flags, head's layers or 0,
    machines)."""
    head, _, rest = spec.partition(":")
    name, _, checkout = head.partition("@")
    env, flags, split, machines = {}, [], 0, False
    for setting in filter(None, rest.split(",")):
        if setting == "machines":
            machines = True
        elif setting.startswith("layers="):
            split = int(setting.partition("=")[2])
        elif setting.startswith("--"):
            flags += setting.split("=", 1)
        else:
            var, _, value = setting.partition("=")
            env[var] = value
    return name, checkout, env, flags, split, machines


def start(procs: fb.Procs, spec: str, model: str, layers: int, tmp: Path, traced: bool) -> fb.Cluster:
    from fabric.wire.shard import Shard

    name, checkout, env, flags, split, machines = parse(spec)
    node_args = ("--quant", "auto", *flags)
    shards = ([Shard(0, split - 1, layers), Shard(split, layers - 1, layers)] if split
              else concurrency.up_split(model, node_args, 2))
    c = fb.Cluster(name, name, shards, "auto", traced=traced, env=env,
                   repo=Path(checkout).resolve() if checkout else fb.REPO, machines=machines)
    fb.start_cluster(procs, c, model, tmp, node_args)
    return c


def node_cpu(c: fb.Cluster) -> float:
    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for _, p, _ in c.nodes)


def passes(c: fb.Cluster) -> str:
    """Each traced node's median pass time (ms) per batch size of decode steps, and how many such
    passes ran (in brackets)."""
    out = []
    for i, (_, _, path) in enumerate(c.nodes):
        by: dict[int, list[float]] = {}
        for e in fb.load_trace(path).get("pass", []):
            if all(hop[3] for hop in e[1]):
                by.setdefault(len(e[1]), []).append((e[3] - e[2]) / 1e6)
        out.append(f"node {i}: " + ", ".join(f"{k} rows {statistics.median(v):.2f} ms ({len(v)})"
                                             for k, v in sorted(by.items()) if len(v) > 5))
    return "; ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clusters", nargs="+", help="NAME[@CHECKOUT][:SETTING,...]")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream (default %(default)s)")
    ap.add_argument("--streams", default="1,8", help="stream counts of the waves (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the streams sample at this temperature, a seed each (default 0: greedy; "
                         "an OpenAI request that names none samples at 1)")
    ap.add_argument("--trace", action="store_true", help="nodes under bench/trace_node.py: pass times per batch size")
    args = ap.parse_args()
    from fabric.compute.models import default_cache_root, load_config, resolve

    source = resolve(args.model)
    layers = load_config(source, default_cache_root()).num_hidden_layers
    streams = [int(s) for s in args.streams.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ab-waves-"))
    procs = fb.Procs(tmp)
    clusters = []
    try:
        clusters = [start(procs, spec, args.model, layers, tmp, args.trace) for spec in args.clusters]
        fb.wait_ready(procs, clusters, source.model_id)
        for c in clusters:  # warm: every batch size once
            for n in streams:
                concurrency.wave(c.tracker, source.model_id, n, 8)
        report(clusters, streams, measure(clusters, streams, source.model_id, args))
    finally:
        procs.stop()
    if args.trace:
        for c in clusters:
            print(f"{c.key} passes: {passes(c)}")
            hops = fb.hop_breakdown(c)  # one-stream steps: compute, legs and their parts (µs)
            if hops:
                print(f"{c.key} one-stream steps: " + ", ".join(
                    f"{k[:-3]} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in hops.items()
                    if not isinstance(v, list)) + "; compute " + ", ".join(f"{v:.0f}" for v in hops["compute_us"]))


def measure(clusters: list, streams: list[int], model: str, args) -> dict[str, dict]:
    """The waves, alternated: per (cluster, streams) each wave's tok/s, node CPU ms per token and
    its last stream's first token (ms from the wave's start)."""
    runs = {what: {(c.key, n): [] for c in clusters for n in streams} for what in ("tps", "cpu", "first")}
    for rep in range(args.reps):
        line = []
        for n in streams:
            for c in clusters if rep % 2 == 0 else clusters[::-1]:
                before, firsts = node_cpu(c), []
                rate, _ = concurrency.wave(c.tracker, model, n, args.tokens, firsts, args.temperature)
                runs["cpu"][(c.key, n)].append((node_cpu(c) - before) / (n * args.tokens) * 1e3)
                runs["tps"][(c.key, n)].append(rate)
                runs["first"][(c.key, n)].append(max(firsts) * 1e3)
                line.append(f"{c.key}/{n} {rate:.1f}")
        print(f"rep {rep + 1}: " + "  ".join(line), flush=True)
    return runs


def report(clusters: list, streams: list[int], runs: dict[str, dict]) -> None:
    med = {what: {k: statistics.median(v) for k, v in by.items()} for what, by in runs.items()}
    tps = med["tps"]
    for n in streams:
        print(f"{n} stream(s), tok/s (node CPU ms per token; last first token, ms): " + "  ".join(
            f"{c.key} {tps[(c.key, n)]:.1f} ({med['cpu'][(c.key, n)]:.1f}; {med['first'][(c.key, n)]:.0f})"
            for c in clusters))
    for c in clusters[1:]:
        print(f"{c.key} against {clusters[0].key}: " + "  ".join(
            f"{n} stream(s) {tps[(c.key, n)] / tps[(clusters[0].key, n)]:.2f}x" for n in streams))
    if len(streams) > 1:
        low, high = streams[0], streams[-1]
        print("  ".join(f"{c.key}: {high} against {low} {tps[(c.key, high)] / tps[(c.key, low)]:.2f}x"
                        for c in clusters))

if __name__ == "__main__":
    main()
