#!/usr/bin/env python
"""Failover stall and cancel latency on real processes, as users run them.

    python bench/failover.py [--model smollm2-135m] [--runs 3] [--tokens 48] [--victim tail|head|both]
                             [--quant none|auto|int8|int4]

Starts a tracker, two heads holding the first half of the layers and two tails holding the
second half (``python -m fabric.cli ...``). For each run it streams a greedy request,
``kill -9``s the tail serving it (its head re-prefills on the other tail) or the head
serving it (the client goes on at the other head, with the tokens it has) after a few
tokens, restarts it, and reports the longest pause between tokens (target < 2 s) against
the median gap of the same stream, and whether the text equals an uninterrupted run. Then
it cancels a stream mid-generation and reports how long until every node holds zero
sessions (target < 1 s).
"""
from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fabric import Client
from fabric.compute.models import load_config, resolve
from fabric.cli.supervision import stop_processes
from tests.cluster import free_port, wait_sessions_zero  # noqa: E402
from tests.support import wait_for

MESSAGES = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


class Cluster:
    def __init__(self, model: str, tmp: Path, quant: str = "none"):
        self.model, self.tmp, self.quant = model, tmp, quant
        self.tracker = f"tcp://127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoints: dict[str, str] = {}  # node -> the endpoint it was started on
        self.layers = load_config(resolve(model)).num_hidden_layers
        self._run("tracker", "tracker", "--bind", self.tracker, "--pub", f"tcp://127.0.0.1:{free_port()}",
                  "--db", str(tmp / "ledger.sqlite3"), "--heartbeat", "0.5")

    def _run(self, name: str, *args: str) -> None:
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "fabric.cli", "--log-level", "warning", *args],
                                            cwd=REPO)

    def node(self, name: str, layers: str) -> None:
        self.endpoints[name] = f"tcp://127.0.0.1:{free_port()}"
        self._run(name, "node", "--model", self.model, "--layers", layers, "--tracker", self.tracker,
                  "--node-id", name, "--bind", self.endpoints[name], "--threads", "1", "--no-progress",
                  "--heartbeat", "0.5", "--quant", self.quant)

    def wait(self, names: set[str]) -> list[str]:
        """The nodes' endpoints, once the tracker lists each at the endpoint it has now (a node
        started again is listed at its old one until that expires)."""
        with Client(self.tracker, timeout=2) as client:
            def ready():
                try:
                    listed = {(n["id"], n["endpoint"]) for n in client.status()["nodes"]}
                except Exception:
                    return False
                return all((name, self.endpoints[name]) in listed for name in names)
            assert wait_for(ready, 300, 0.2), "nodes did not come up"
        return [self.endpoints[name] for name in sorted(names)]

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        stop_processes(list(self.procs.values()), grace=30)


def stream(cluster: Cluster, tokens: int, kill_after: int | None, victim: str = "tail") -> tuple[list[int], list]:
    """Token ids and arrival times; kills the route's ``victim`` (tail or head) after ``kill_after``
    tokens, and starts it again once the stream ended (a process loading a model would slow the
    stream it is measured on: two cores)."""
    ids, stamps, node = [], [], None
    with Client(cluster.tracker, timeout=120) as client:
        for event in client.generate(cluster.model, messages=MESSAGES, max_tokens=tokens):
            if event.event == "start":
                node = event.route[-1 if victim == "tail" else 0].node
            if event.token_ids:
                ids.extend(event.token_ids)
                stamps.append(time.perf_counter())
            if kill_after is not None and len(ids) == kill_after and node in cluster.procs:
                cluster.kill(node)
    if kill_after is not None:
        half = cluster.layers // 2
        cluster.node(node, f"{half}-{cluster.layers - 1}" if victim == "tail" else f"0-{half - 1}")
    return ids, stamps


def cancel_latency(cluster: Cluster, endpoints: list[str]) -> float:
    with Client(cluster.tracker, timeout=120) as client:
        events = client.generate(cluster.model, messages=MESSAGES, max_tokens=400)
        for _ in range(4):
            next(events)
        events.close()
    return wait_sessions_zero(endpoints, timeout=10.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--victim", choices=["tail", "head", "both"], default="both",
                        help="the node of the route to kill -9: its tail, its head, or each in turn")
    parser.add_argument("--quant", default="none", choices=["auto", "none", "int8", "int4"],
                        help="the nodes' --quant (default %(default)s: float32, where a re-prefill gives the very "
                             "tokens of the uninterrupted run; see bench/default_mode.py for auto)")
    args = parser.parse_args()
    victims = ["tail", "head"] if args.victim == "both" else [args.victim]
    names = {"head1", "head2", "tail1", "tail2"}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(args.model, Path(tmp), args.quant)
        try:
            half = cluster.layers // 2
            for head in ("head1", "head2"):
                cluster.node(head, f"0-{half - 1}")
            for tail in ("tail1", "tail2"):
                cluster.node(tail, f"{half}-{cluster.layers - 1}")
            cluster.wait(names)
            expected, _ = stream(cluster, args.tokens, None)
            rows = []
            for victim in victims:
                for _ in range(args.runs):
                    cluster.wait(names)
                    ids, stamps = stream(cluster, args.tokens, kill_after=5, victim=victim)
                    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                    rows.append((victim, max(gaps), statistics.median(gaps), ids == expected))
            endpoints = cluster.wait(names)
            cancel = [cancel_latency(cluster, endpoints) for _ in range(args.runs)]
        finally:
            cluster.close()
    print(f"failover on {args.model}: two heads 0-{half - 1}, two tails {half}-{cluster.layers - 1}, "
          "kill -9 after 5 tokens")
    for i, (victim, longest, median, same) in enumerate(rows, 1):
        print(f"  run {i}, {victim} killed: longest pause {longest:.2f} s (median gap {median * 1000:.0f} ms, "
              f"{longest / median:.0f}x), text unchanged: {same}")
    worst = max(r[1] for r in rows)
    print(f"  target longest pause < 2 s: {'PASS' if worst < 2 else 'MISS'} (worst {worst:.2f} s)")
    print(f"  cancel -> every node at zero sessions: {', '.join(f'{c * 1000:.0f} ms' for c in cancel)}; "
          f"target < 1 s: {'PASS' if max(cancel) < 1 else 'MISS'}")
    return 0 if worst < 2 and all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
