#!/usr/bin/env python
"""The default mode (a GGUF on its own grid, ``--quant auto``) against exact mode
(``--quant none --dtype float32``): decode speed, greedy agreement and failover, in one run.

    python bench/default_mode.py [--model smollm2-135m] [--tokens 64] [--rounds 3] [--prompts 8] [--threads 0]
                                 [--failover-trials 20] [--control-trials 5] [--parts speed,failover]

speed: two clusters side by side, each a tracker and a 2-node split as ``meshnet up``
starts them (all cores each; one compute lock for all four nodes, so the clusters take
turns and never compute at once): one with the nodes' defaults, one with ``--quant none
--dtype float32``. Each round asks every prompt of both clusters back to back (which one
goes first alternates), greedy, exactly ``--tokens`` tokens (``ignore_eos``). Decode tok/s
of a round: tokens after the first over the time from first to last, summed over the
prompts. The ratio default / exact is taken per round (the machine's speed drifts between
rounds), and its median reported. Beside each round: the CPU time the cluster spent per
token, and the share of the CPU other tenants used.

agreement: the first round's greedy tokens of the two modes, prompt by prompt: tokens
before the first difference, and the share of positions that agree.

failover: an in-process cluster (tracker and nodes in threads, real loopback sockets): a
head with the first half of the layers, two tails with the second. Each trial streams a
prompt of its own uninterrupted, then again, and stops the tail serving it after k tokens
(k spread over the reply; the node's loop ends and its sockets close, as in a crash); the
head fails over to the other tail and re-prefills the history there. A fresh tail then
replaces the dead one. Counted: trials whose text differs from the uninterrupted run, with
the first differing token after the switch. KV reuse across requests is off on these nodes,
so each trial's two runs compute alike until the switch. ``--control-trials`` runs the
same in exact mode.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from concurrency import start_cluster  # noqa: E402
from fabric_bench import LoadMeter  # noqa: E402

import psutil

from fabric import Client, FabricError
from fabric.cli.supervision import stop_processes
from fabric.compute.models import default_cache_root, load_config, pick_quant, resolve

EXACT = ("--quant", "none", "--dtype", "float32")
SUBJECTS = ["a lighthouse keeper", "a baker", "a lost cat", "a river", "an old clock", "a mountain guide",
            "a library", "a robot gardener", "a fisherman", "a snowstorm", "a violin", "a train station",
            "a beekeeper", "a desert town", "a painter", "a submarine", "a night market", "a tortoise",
            "a kite", "a blacksmith", "a comet", "a tailor", "an island", "a chess player"]
QUESTIONS = ["Why is the sky blue?", "Name three prime numbers.", "Write a haiku about rivers.",
             "What is a transformer model?", "Describe a cat in one sentence.", "What is 12 times 12?",
             "Give me a synonym for happy.", "Where is the Eiffel Tower?", "How do plants make food?",
             "What is the boiling point of water?", "Explain gravity to a child.", "List four colours."]


def timed(tracker: str, model: str, question: str, tokens: int) -> tuple[list[int], float]:
    """Greedy token ids of one request, and the seconds from its first token to its last."""
    ids, stamps = [], []
    with Client(tracker, timeout=600) as client:
        for event in client.generate(model, messages=[{"role": "user", "content": question}], max_tokens=tokens,
                                     ignore_eos=True):
            if event.token_ids:
                ids.extend(event.token_ids)
                stamps.append(time.perf_counter())
    return ids, stamps[-1] - stamps[0]


def cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """CPU time (user + system) the processes of a cluster have used so far."""
    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)


def speed_round(clusters: dict[str, tuple], model: str, questions: list[str], tokens: int, flip: bool) -> dict:
    """One round: every question on both clusters, back to back. tok/s, CPU ms per token
    (prefill included: less disturbed by other tenants than wall time) and ids per mode."""
    done = {name: [0, 0.0, [], 0.0, 0] for name in clusters}  # decode tokens, seconds, ids, CPU s, tokens
    order = list(clusters)[::-1] if flip else list(clusters)
    with LoadMeter() as meter:
        for question in questions:
            for name in order:
                procs, tracker = clusters[name]
                cpu = cpu_seconds(procs)
                ids, seconds = timed(tracker, model, question, tokens)
                d = done[name]
                d[0], d[1], d[3], d[4] = d[0] + len(ids) - 1, d[1] + seconds, d[3] + cpu_seconds(procs) - cpu, \
                    d[4] + len(ids)
                d[2].append(ids)
    return {"tok_s": {n: d[0] / d[1] for n, d in done.items()}, "ids": {n: d[2] for n, d in done.items()},
            "cpu_ms": {n: d[3] * 1000 / d[4] for n, d in done.items()}, "foreign": meter.foreign}


def first_difference(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference (len when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(default: list[list[int]], exact: list[list[int]]) -> dict:
    same = [first_difference(a, b) for a, b in zip(default, exact)]
    positions = sum(x == y for a, b in zip(default, exact) for x, y in zip(a, b))
    return {"first_n": same, "identical": sum(s == len(b) for s, b in zip(same, exact)),
            "share": positions / sum(len(b) for b in exact)}


def run_speed(args) -> dict:
    """Both clusters up, ``--rounds`` rounds; returns the rounds and the agreement of the first."""
    model = resolve(args.model).model_id
    questions = QUESTIONS[:args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {}
        try:
            for name, extra in (("default", ()), ("exact", EXACT)):
                (Path(tmp) / name).mkdir()
                lock = ("--compute-lock", str(Path(tmp) / "compute.lock"))
                clusters[name] = start_cluster(args.model, 2, Path(tmp) / name, threads=args.threads,
                                               node_args=(*extra, *lock))
            for _, tracker in clusters.values():  # warm-up: first requests pay one-off costs
                timed(tracker, model, questions[0], 4)
            rounds = [speed_round(clusters, model, questions, args.tokens, flip=i % 2 == 1)
                      for i in range(args.rounds)]
        finally:
            for procs, _ in clusters.values():
                stop_processes(procs, grace=30)
    return {"rounds": rounds, "agreement": agreement(rounds[0]["ids"]["default"], rounds[0]["ids"]["exact"])}


def report_speed(args, result: dict) -> None:
    scheme, why = pick_quant("auto", resolve(args.model))
    threads = f"--threads {args.threads}" if args.threads else "all cores per node, as `meshnet up`"
    print(f"default mode (--quant auto: {scheme}, {why}) vs exact (--quant none --dtype float32), {args.model}, "
          f"2-node split ({threads}), {args.prompts} prompts x {args.tokens} tokens, greedy")
    ratios = []
    for i, r in enumerate(result["rounds"], 1):
        ratio = r["tok_s"]["default"] / r["tok_s"]["exact"]
        ratios.append(ratio)
        print(f"  round {i}: default {r['tok_s']['default']:6.1f} tok/s ({r['cpu_ms']['default']:.0f} CPU ms/token)"
              f"  exact {r['tok_s']['exact']:6.1f} tok/s ({r['cpu_ms']['exact']:.0f})  ratio {ratio:.2f}x  "
              f"(other tenants {r['foreign'] * 100:.0f}% of the CPU)")
    med = {m: statistics.median(r["tok_s"][m] for r in result["rounds"]) for m in ("default", "exact")}
    cpu = {m: statistics.median(r["cpu_ms"][m] for r in result["rounds"]) for m in ("default", "exact")}
    print(f"  median: default {med['default']:.1f} tok/s, exact {med['exact']:.1f} tok/s; "
          f"default / exact {statistics.median(ratios):.2f}x (median of the rounds' ratios); CPU ms per token "
          f"{cpu['default']:.0f} vs {cpu['exact']:.0f} ({cpu['exact'] / cpu['default']:.2f}x less)")
    a = result["agreement"]
    print(f"  greedy agreement with float32 (round 1): {a['identical']}/{len(a['first_n'])} prompts identical over "
          f"{args.tokens} tokens; tokens before the first difference {a['first_n']} (median "
          f"{statistics.median(a['first_n']):.0f}); {a['share'] * 100:.0f}% of positions equal")


# --------------------------------------------------------------------------- failover


class Replicas:
    """A thread cluster: a head and two tails of ``model`` in one mode, tails replaceable."""

    def __init__(self, model: str, quant: str | None, dtype):
        from tests.cluster import ThreadCluster

        self.model, self.quant, self.dtype = model, quant, dtype
        self.source = resolve(model)
        self.layers = load_config(self.source, default_cache_root()).num_hidden_layers
        self.cluster = ThreadCluster(heartbeat=0.2)
        self.tails: dict[str, threading.Event] = {}
        self.born = 0
        self._node("head", 0, self.layers // 2 - 1, self.cluster.stop)
        self.spawn()
        self.spawn()

    def _node(self, node_id: str, start: int, end: int, stop: threading.Event) -> None:
        from fabric.node import Node, NodeConfig
        from fabric.wire.shard import Shard

        config = NodeConfig.build(self.source, Shard(start, end, self.layers), tracker=self.cluster.endpoint,
                                  node_id=node_id, progress=False, heartbeat_interval=self.cluster.heartbeat,
                                  quant=self.quant, dtype=self.dtype, kv_cache_bytes=0,
                                  cache_root=default_cache_root())
        node = Node(config)
        thread = threading.Thread(target=node.run, args=(stop,), daemon=True)
        thread.start()
        self.cluster.threads.append(thread)
        node.ready.wait(30)

    def spawn(self) -> None:
        self.born += 1
        name, stop = f"tail-{self.born}", threading.Event()
        self._node(name, self.layers // 2, self.layers - 1, stop)
        self.tails[name] = stop

    def wait(self) -> None:
        from tests.support import wait_for

        want = {"head", *self.tails}

        def ready() -> bool:
            try:
                with self.cluster.client() as client:
                    return {n["id"] for n in client.status()["nodes"]} == want
            except FabricError:  # a busy machine: ask again
                return False
        assert wait_for(ready, 60, 0.1), "the replicas did not register"

    def stream(self, question: str, tokens: int, kill_after: int | None = None) -> list[int]:
        ids, victim = [], None
        with self.cluster.client() as client:
            client.timeout = 120
            for event in client.generate(self.source.model_id, messages=[{"role": "user", "content": question}],
                                         max_tokens=tokens, ignore_eos=True):
                victim = victim or event.route[-1].node
                ids.extend(event.token_ids)
                if kill_after is not None and len(ids) >= kill_after and victim in self.tails:
                    self.tails.pop(victim).set()  # the tail's loop ends and its sockets close
        return ids


def failover_trials(model: str, quant: str | None, dtype, trials: int, tokens: int) -> list[dict]:
    replicas = Replicas(model, quant, dtype)
    rows = []
    try:
        for i in range(trials):
            replicas.wait()
            question = f"Tell me a short story about {SUBJECTS[i % len(SUBJECTS)]}."
            expected = replicas.stream(question, tokens)
            kill_after = 2 + (i * 7) % (tokens - 8)
            got = replicas.stream(question, tokens, kill_after)
            rows.append({"kill_after": kill_after, "same": got == expected,
                         "first_difference": first_difference(got, expected)})
            replicas.spawn()
    finally:
        for stop in replicas.tails.values():
            stop.set()
        replicas.cluster.close()
    return rows


def report_failover(label: str, rows: list[dict], tokens: int) -> None:
    differ = [r for r in rows if not r["same"]]
    print(f"  {label}: {len(differ)}/{len(rows)} trials differ from the uninterrupted text ({tokens} tokens, tail "
          f"stopped after k tokens)")
    for r in differ:
        print(f"    stopped after {r['kill_after']}: first different token at {r['first_difference']} "
              f"({r['first_difference'] - r['kill_after']} after the switch)")


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, choices=range(1, len(QUESTIONS) + 1), metavar="N",
                        help=f"prompts per round, at most {len(QUESTIONS)} (default %(default)s)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per node in the speed part, 0 for all cores (default %(default)s)")
    parser.add_argument("--failover-trials", type=int, default=20, help="default-mode trials (default %(default)s)")
    parser.add_argument("--control-trials", type=int, default=5, help="exact-mode trials (default %(default)s)")
    parser.add_argument("--failover-tokens", type=int, default=48, help="tokens per trial (default %(default)s)")
    parser.add_argument("--parts", default="speed,failover", help="speed, failover or both (default %(default)s)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if "speed" in parts:
        report_speed(args, run_speed(args))
    if "failover" in parts:
        scheme, _ = pick_quant("auto", resolve(args.model))
        print(f"failover, {args.model}: head + two tails in threads, KV reuse off")
        rows = failover_trials(args.model, scheme, torch.bfloat16 if scheme else torch.float32,
                               args.failover_trials, args.failover_tokens)
        report_failover(f"default mode ({scheme or 'none'})", rows, args.failover_tokens)
        if args.control_trials:
            rows = failover_trials(args.model, None, torch.float32, args.control_trials, args.failover_tokens)
            report_failover("exact mode (float32)", rows, args.failover_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
