#!/usr/bin/env python
"""Load test: N concurrent streaming clients for M seconds against a local cluster.

    python bench/load.py [--model smollm2-135m] [--clients 8] [--seconds 30] [--max-tokens 32]

Starts ``meshnet up`` (tracker, 2 nodes, web UI) on free loopback ports, then N threads
each send streaming chat requests to /v1/chat/completions back to back for M seconds.
Prints p50/p99 time to first token and inter-token latency, the error count (must be 0),
the sessions nodes still hold afterwards (must be 0) and every node's resident memory
before and after (growth beyond noise means a leak). Exits non-zero when errors or held
sessions are not 0. Every request loop is bounded in count and time; all traffic stays
on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from fabric import Client
from tests.cluster import free_port, ping  # noqa: E402
from tests.support import wait_for

PROMPTS = ["Why is the sky blue?", "Name three prime numbers.", "Write a haiku about rivers.",
           "What is a transformer model?"]


@dataclass
class Results:
    ttft: list[float] = field(default_factory=list)  # seconds to the first content chunk
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_request(port: int, model: str, prompt: str, max_tokens: int, out: Results) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True})
    start, stamps = time.perf_counter(), []
    try:
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if line.startswith(b"data: {") and b'"error"' in line:
                raise RuntimeError(line.decode().strip())
            if line.startswith(b"data: {") and b'"content"' in line:
                stamps.append(time.perf_counter())
    except Exception as exc:  # every failure counts; the load goes on
        with out.lock:
            out.errors.append(f"{type(exc).__name__}: {exc}")
        return
    finally:
        conn.close()
    with out.lock:
        out.requests += 1
        out.tokens += len(stamps)
        if stamps:
            out.ttft.append(stamps[0] - start)
            out.itl.extend(b - a for a, b in zip(stamps, stamps[1:]))


def client_loop(i: int, port: int, model: str, deadline: float, max_tokens: int, out: Results) -> None:
    n = 0
    while time.monotonic() < deadline and n < 10_000:
        one_request(port, model, PROMPTS[(i + n) % len(PROMPTS)], max_tokens, out)
        n += 1


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def node_processes(up: psutil.Process) -> list[psutil.Process]:
    return [p for p in up.children(recursive=True) if " node " in " ".join(p.cmdline())]


def start_cluster(model: str, nodes: int) -> tuple[subprocess.Popen, int, str]:
    port, tracker, pub = free_port(), f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    up = subprocess.Popen([sys.executable, "-m", "fabric.cli", "--log-level", "warning", "up", "--model", model,
                           "--nodes", str(nodes), "--port", str(port), "--tracker", tracker, "--pub", pub],
                          cwd=REPO, stdout=subprocess.DEVNULL)
    with Client(tracker, timeout=2) as client:
        def ready():
            try:
                return any(client.status()["plans"].values())
            except Exception:
                return False
        if not wait_for(ready, 300, 0.5):
            up.kill()
            raise SystemExit("the cluster did not come up")
    wait_for(lambda: _http_ok(port), 60, 0.2)
    return up, port, tracker


def _http_ok(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/v1/models")
        return conn.getresponse().status == 200
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    up, port, tracker = start_cluster(args.model, args.nodes)
    try:
        model = json.loads(_get(port, "/v1/models"))["data"][0]["id"]
        one_request(port, model, "warm up", 4, Results())
        procs = node_processes(psutil.Process(up.pid))
        rss_before = [p.memory_info().rss for p in procs]
        out = Results()
        deadline = time.monotonic() + args.seconds
        threads = [threading.Thread(target=client_loop, args=(i, port, model, deadline, args.max_tokens, out))
                   for i in range(args.clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        with Client(tracker) as client:
            endpoints = [n["endpoint"] for n in client.status()["nodes"]]
        held = sum(getattr(ping(e), "sessions", 0) or 0 for e in endpoints)
        rss_after = [p.memory_info().rss for p in procs]
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
    report(args, out, elapsed, held, rss_before, rss_after)
    return 0 if not out.errors and held == 0 else 1


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    return conn.getresponse().read()


def report(args, out: Results, elapsed: float, held: int, before: list[int], after: list[int]) -> None:
    ms = lambda v: f"{v * 1000:.0f} ms"  # noqa: E731
    print(f"load: {args.clients} streaming clients for {elapsed:.0f} s on {args.model} ({args.nodes} nodes)")
    print(f"  requests {out.requests}, tokens {out.tokens}, aggregate {out.tokens / elapsed:.1f} tok/s")
    print(f"  time to first token  p50 {ms(pct(out.ttft, .5))}  p99 {ms(pct(out.ttft, .99))}")
    print(f"  inter-token latency  p50 {ms(pct(out.itl, .5))}  p99 {ms(pct(out.itl, .99))}"
          f"  (mean {ms(statistics.fmean(out.itl)) if out.itl else 'n/a'})")
    print(f"  errors {len(out.errors)}{' e.g. ' + out.errors[0] if out.errors else ''}")
    print(f"  sessions held after {held}")
    for i, (b, a) in enumerate(zip(before, after)):
        print(f"  node {i} RSS {b / 2**20:.0f} MiB -> {a / 2**20:.0f} MiB ({(a - b) / 2**20:+.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
