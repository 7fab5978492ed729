#!/usr/bin/env python
"""What audits cost and what they catch, on real processes.

    python bench/audit.py [--model smollm2-135m] [--rounds 3] [--clients 4] [--requests 3]
                          [--tokens 32] [--trials 3] [--max-requests 80] [--lies all,decode] [--no-noise]

Starts a tracker, three heads holding the first half of the layers, identical but for
``--audit-rate`` (0, the default 0.05, and 1), and two tails holding the second half (one
is the other's replica). Nodes are ``meshnet node`` processes (``--threads 1``, as the tests
run them).

Throughput: in each round, for each head in turn (interleaved), ``--clients`` concurrent
clients each send ``--requests`` greedy chat requests of ``--tokens`` tokens through that
head (the tails alternate). Every prompt is new (they share only the chat template's system
prompt). Reported per head: aggregate tokens/s, and the CPU seconds this process and the
swarm (its children) spent per token: the throughput of a saturated swarm is inversely
proportional to that, and it is far less disturbed than tokens/s by other tenants of a
shared machine. The cost of an audit rate is its extra CPU per token over the head that
audits nothing (median of the rounds' ratios; target at the default rate: at most 5%): at a
rate above 0 every hop sketches every step for its head (AUDIT_TAP), and a share ``rate``
of the requests is replayed on replicas after it ends. The default rate replays few
requests per round, so ``the taps' cost + rate x the replays' cost`` is given too, the
replays' cost being what auditing every request costs beyond the taps (taps alone are
measured by a fourth head whose rate is tiny: it sketches every step and replays almost
nothing).

Detection: a lying tail (tests/liar_node.py) joins, for each mode of ``--lies`` (``all``:
every step wrong; ``decode``: only decode steps, its prefills honest); requests go through
it from one head until the tracker excludes it, ``--trials`` times per audit rate and mode
(a fresh liar each time). Reported: how many requests it served until it was caught
(expected 1/rate: each request is replayed with that probability, every hop at once), and
how many of its answers differed from an honest tail's.

Noise: how far apart honest outputs of one audited step can be. Layers 1 to the last, run on
the same 200 positions of seeded hidden states, in each mode (float32; bfloat16; int8 and
int4, computed in bfloat16), by this CPU's own kernels and by its AVX2 ones
(``ATEN_CPU_CAPABILITY=avx2``), as two honest nodes on different CPUs would: their relative
distance, against the tolerance (``--audit-tolerance``) and against a lying node's output
(reversed along the hidden dimension, as tests/liar_node.py does).
"""
from __future__ import annotations

import argparse
import itertools
import os
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

from fabric.compute.models import load_config, resolve  # noqa: E402
from fabric.wire.liveness import AUDIT_RATE, AUDIT_TOLERANCE  # noqa: E402
from fabric.wire.protocol import Hop  # noqa: E402
from tests.cluster import ProcessCluster, node_counters  # noqa: E402
from tests.support import at_once, free_port, wait_for  # noqa: E402

RATES = {"off": 0.0, "taps": 1e-9, "default": AUDIT_RATE, "all": 1.0}
DETECT_TOKENS = 12  # tokens per request through a liar: a prefill and eleven decode steps
TOPICS = ["lighthouses", "rivers", "prime numbers", "volcanoes", "bees", "glaciers", "comets", "forests", "deserts",
          "clocks", "bridges", "whales"]


class Prompts:
    """A new prompt for every request (no two share their start for long, so none reuses kept KV)."""

    def __init__(self):
        self._count = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> list[dict]:
        with self._lock:
            n = next(self._count)
        return [{"role": "user", "content": f"{n}. Tell me one fact about {TOPICS[n % len(TOPICS)]}, #{n * 7919}."}]


class Swarm:
    def __init__(self, cluster: ProcessCluster, model: str):
        self.cluster, self.model = cluster, model
        self.layers = load_config(resolve(model)).num_hidden_layers
        self.half = self.layers // 2
        self.nodes: dict[str, dict] = {}
        self.metrics = {name: free_port() for name in RATES}  # each head's /metrics port

    def start(self) -> None:
        for name, rate in RATES.items():
            self.cluster.start_node(f"head-{name}", self.model, f"0-{self.half - 1}", None, "--audit-rate", str(rate),
                                    "--metrics-port", str(self.metrics[name]))
        for tail in ("tail1", "tail2"):
            self.cluster.start_node(tail, self.model, f"{self.half}-{self.layers - 1}")
        self.refresh([f"head-{n}" for n in RATES] + ["tail1", "tail2"])

    def refresh(self, names: list[str]) -> None:
        status = self.cluster.wait_nodes(names, resolve(self.model).model_id, timeout=300)
        self.nodes = {n["id"]: n for n in status["nodes"]}

    def route(self, head: str, tail: str) -> tuple[Hop, ...]:
        return (Hop(head, self.nodes[head]["endpoint"], 0, self.half - 1),
                Hop(tail, self.nodes[tail]["endpoint"], self.half, self.layers - 1))

    def ask(self, route: tuple[Hop, ...], messages: list[dict], tokens: int) -> list[int]:
        with self.cluster.client() as client:
            events = client.generate(resolve(self.model).model_id, messages=messages, max_tokens=tokens,
                                     route=route, ignore_eos=True)
            return [t for e in events for t in e.token_ids]

    def excluded(self, node: str) -> bool:
        with self.cluster.client() as client:
            return any(n["id"] == node and n["excluded"] for n in client.status()["nodes"])


def throughput(swarm: Swarm, prompts: Prompts, head: str, clients: int, requests: int,
               tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of ``clients`` clients sending ``requests`` requests each through ``head``."""
    def client(i: int) -> int:
        return sum(len(swarm.ask(swarm.route(head, f"tail{1 + (i + r) % 2}"), prompts.next(), tokens))
                   for r in range(requests))

    started = time.perf_counter()
    done = at_once(client, clients, timeout=600)
    elapsed = time.perf_counter() - started
    if len(done) != clients:
        raise RuntimeError(f"{clients - len(done)} client(s) of {head} failed")
    return sum(done.values()), elapsed


def cost_rounds(swarm: Swarm, prompts: Prompts, args) -> dict[str, list[tuple[float, float]]]:
    """Per head, each round's (tokens/s, CPU seconds per token)."""
    from fabric_bench import LoadMeter

    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in RATES}
    for r in range(args.rounds):
        for name in (RATES if r % 2 == 0 else reversed(list(RATES))):  # interleaved, the order alternating
            with LoadMeter() as meter:
                tokens, seconds = throughput(swarm, prompts, f"head-{name}", args.clients, args.requests, args.tokens)
            rows[name].append((tokens / seconds, meter.mine / tokens))
            print(f"  round {r + 1}, --audit-rate {RATES[name]:g}: {rows[name][-1][0]:.2f} tok/s, "
                  f"{1000 * rows[name][-1][1]:.1f} CPU ms per token (other tenants {100 * meter.foreign:.0f}% of "
                  f"the CPU)", flush=True)
    requests = args.rounds * args.clients * args.requests
    for name, port in swarm.metrics.items():
        counts = node_counters(port, "audits")
        print(f"  head-{name}: {counts['audits']:.0f} audits in {requests} requests ({counts['audits_passed']:.0f} "
              f"passed, {counts['audits_skipped']:.0f} given up, {counts['audits_convicted']:.0f} convictions, "
              f"{counts['audits_unsettled']:.0f} unsettled)")
    return rows


def detection_trial(swarm: Swarm, prompts: Prompts, head: str, liar: str, limit: int, tokens: int) -> tuple[int, int]:
    """(requests through ``liar`` until the tracker excluded it, how many of those answers were wrong).
    A replay runs after its request ends: each request waits a moment for one to convict."""
    wrong = 0
    for n in range(1, limit + 1):
        messages = prompts.next()
        got = swarm.ask(swarm.route(head, liar), messages, tokens)
        wrong += got != swarm.ask(swarm.route("head-off", "tail1"), messages, tokens)
        if wait_for(lambda: swarm.excluded(liar), 3.0 if n == 1 else 1.0, 0.1):
            return n, wrong
    return limit + 1, wrong


def detection(swarm: Swarm, prompts: Prompts, args) -> dict[tuple[str, str], list[tuple[int, int]]]:
    found: dict[tuple[str, str], list[tuple[int, int]]] = {}
    trial = itertools.count(1)
    for lie in args.lies.split(","):
        for name in ("default", "all"):
            found[(name, lie)] = []
            for _ in range(args.trials):
                liar = f"liar{next(trial)}"
                swarm.cluster.start_node(liar, swarm.model, f"{swarm.half}-{swarm.layers - 1}", liar=lie)
                swarm.refresh([liar])
                found[(name, lie)].append(detection_trial(swarm, prompts, f"head-{name}", liar, args.max_requests,
                                                          DETECT_TOKENS))
                swarm.cluster.kill(liar)
                caught, wrong = found[(name, lie)][-1]
                print(f"  --audit-rate {RATES[name]:g}, lying on {lie} steps: {liar} "
                      f"{caught_after(caught, args.max_requests)}, {wrong} answer(s) through it wrong", flush=True)
    return found


NOISE_RUN = r"""
import sys, torch
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_config, load_shard, resolve
from fabric.wire.shard import Shard
model, dtype, quant, out = sys.argv[1:]
torch.set_num_threads(1)
source = resolve(model)
last = load_config(source).num_hidden_layers - 1
ex = ShardExecutor(load_shard(source, Shard(1, last, last + 1), dtype=getattr(torch, dtype), progress=False,
                              quant=None if quant == "none" else quant), KVStore())
x = torch.randn(1, 200, ex.hidden_size, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
honest = ex.run("honest", 1, last, x, 0).logits  # (vocab,)
import tests.liar_node  # from here on this executor lies, as the liar of the tests does
torch.save({"honest": honest, "liar": ex.run("liar", 1, last, x, 0).logits}, out)
"""


def noise(model: str, tmp: Path) -> None:
    """Relative distance between honest outputs of one step by this CPU's kernels and its AVX2 ones,
    and a liar's from the honest one."""
    import torch

    from fabric.node.verdicts import distance

    print(f"\nhonest noise on {model}: layers 1 to the last on 200 positions, this CPU's kernels "
          f"({torch.backends.cpu.get_cpu_capability()}) vs AVX2 ones (tolerance {AUDIT_TOLERANCE:g}):", flush=True)
    for dtype, quant in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")):
        runs = []
        for capability in ("", "avx2"):
            out = tmp / f"noise-{dtype}-{quant}-{capability or 'native'}.pt"
            env = {**os.environ, "PYTHONPATH": str(REPO), **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
            subprocess.run([sys.executable, "-c", NOISE_RUN, model, dtype, quant, str(out)], env=env, check=True,
                           capture_output=True)
            runs.append(torch.load(out))
        native, avx2 = runs
        mode = dtype if quant == "none" else f"{dtype} {quant}"
        honest, other = native["honest"], avx2["honest"]
        print(f"  {mode}: bit-equal {torch.equal(honest, other)}, relative distance {distance(honest, other):.2g}; "
              f"the liar's {distance(native['liar'], honest):.2g}")


def caught_after(requests: int, limit: int) -> str:
    return f"caught at request {requests} through it" if requests <= limit else f"not caught in {limit} requests"


def report(args, rows: dict[str, list[tuple[float, float]]],
           found: dict[tuple[str, str], list[tuple[int, int]]]) -> bool:
    print(f"\naudits on {args.model}: {args.clients} clients x {args.requests} requests x {args.tokens} tokens "
          f"per head and round, {args.rounds} interleaved rounds")
    cost = {}
    for name in ("taps", "default", "all"):
        speed = [a[0] / b[0] for a, b in zip(rows[name], rows["off"])]
        work = [a[1] / b[1] for a, b in zip(rows[name], rows["off"])]
        cost[name] = statistics.median(work) - 1
        print(f"  --audit-rate {RATES[name]:g} vs 0: CPU per token {1 + cost[name]:.3f}x (rounds "
              f"{', '.join(f'{x:.3f}' for x in work)}): cost {100 * cost[name]:.1f}%; tokens/s "
              f"{statistics.median(speed):.3f}x (rounds {', '.join(f'{x:.2f}' for x in speed)})")
    taps = max(cost["taps"], 0.0)
    scaled = taps + AUDIT_RATE * (cost["all"] - taps)
    ok = cost["default"] <= 0.05 and scaled <= 0.05
    print(f"  cost at the default rate {AUDIT_RATE:g}: measured {100 * cost['default']:.1f}%; the taps "
          f"{100 * taps:.1f}% + {AUDIT_RATE:g} x the replays of every request {100 * (cost['all'] - taps):.1f}% = "
          f"{100 * scaled:.1f}%; target <= 5%: {'PASS' if ok else 'MISS'}")
    for (name, lie), trials in found.items():
        if trials:
            caught = [c for c, _ in trials]
            when = "; ".join(caught_after(c, args.max_requests) for c in caught)
            print(f"  detection at --audit-rate {RATES[name]:g} of a liar on {lie} steps (expected after "
                  f"{1 / RATES[name]:.0f} requests through it): {when}; wrong answers through it meanwhile: "
                  f"{', '.join(str(w) for _, w in trials)}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3, help="requests per client per round")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--trials", type=int, default=3, help="liars caught per audit rate (0: no detection part)")
    parser.add_argument("--max-requests", type=int, default=80, help="requests through a liar before a trial stops")
    parser.add_argument("--lies", default="all,decode", help="how the liars lie: every step (all), decode steps only")
    parser.add_argument("--no-noise", action="store_true", help="skip the measure of honest outputs' noise")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ProcessCluster(Path(tmp), Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")))
        try:
            swarm = Swarm(cluster, args.model)
            swarm.start()
            prompts = Prompts()
            swarm.ask(swarm.route("head-off", "tail1"), prompts.next(), 4)  # warm up
            rows = cost_rounds(swarm, prompts, args)
            found = detection(swarm, prompts, args) if args.trials else {}
        except Exception:
            print(cluster.logs())
            raise
        finally:
            cluster.close()
        ok = report(args, rows, found)
        if not args.no_noise:
            noise(args.model, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
