#!/usr/bin/env python
"""The tracker at swarm scale: the planner, and a real tracker under 1,000 heartbeating nodes.

    python bench/swarm_scale.py [--nodes 1000] [--layers 200] [--rtt-peers 32] [--routes 200]
                                [--clients 4] [--seconds 20] [--heartbeat 1.0] [--seed 1]

1. The planner alone: a simulated swarm of ``--nodes`` nodes over a ``--layers``-layer model
   (random shards of 5-40 layers that cover the model, random benchmarks and load, each
   node with measured round trips to ``--rtt-peers`` random others, as heartbeats carry
   them), planned ``--routes`` times as a ROUTE_REQUEST is (best route, no exclusions,
   then excluding a random node). Prints the median and p99 per route, and one
   ``plan_all`` (3 routes, as the PUB feed gets on a topology change).
2. A real tracker process (``python -m fabric.cli tracker``) on loopback, and ``--clients``
   processes that each simulate their share of the same swarm over real ZeroMQ: one DEALER
   (its own identity) per node, REGISTER, then a HEARTBEAT with its round trips every
   ``--heartbeat`` seconds, re-registering when told to; each process answers the
   tracker's reachability PINGs on one ROUTER that its nodes advertise. Once every node
   is registered, this process asks for a route back to back for ``--seconds`` and prints
   the answer latency (median, p99), with the heartbeats answered meanwhile.

Everything stays on 127.0.0.1. The default run takes about 1-2 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from fabric.wire import protocol as p  # noqa: E402
from tests.support import free_port, wait_for  # noqa: E402
from tracker.node_records import NodeInfo  # noqa: E402
from tracker.planner import plan_all, plan_routes  # noqa: E402

MODEL, FINGERPRINT = "swarm-model", "5ca1ab1e:bench"


def build_swarm(nodes: int, layers: int, rtt_peers: int, seed: int) -> list[NodeInfo]:
    """Random shards that cover the model (the first few tile it), benchmarks, load and round trips."""
    rng = random.Random(seed)
    out = []
    for i in range(nodes):
        width = rng.randint(5, min(40, layers))
        start = min(i * 5, layers - width) if i * 5 < layers else rng.randrange(layers - width + 1)
        out.append(NodeInfo(node_id=f"sim{i:04d}", endpoint="", model=MODEL, fingerprint=FINGERPRINT,
                            num_layers=layers, start_layer=start, end_layer=start + width - 1,
                            benchmark=rng.uniform(200.0, 4000.0), sessions=rng.choice([0, 0, 0, 1, 2]),
                            queued=rng.choice([0] * 9 + [1])))
    ids = [n.node_id for n in out]
    return [replace(n, rtts={peer: round(rng.uniform(0.2, 80.0), 3)
                             for peer in rng.sample(ids, min(rtt_peers + 1, len(ids))) if peer != n.node_id})
            for n in out]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_planner(args: argparse.Namespace) -> None:
    swarm = build_swarm(args.nodes, args.layers, args.rtt_peers, args.seed)
    rng = random.Random(args.seed)
    times = []
    for i in range(args.routes):
        exclude = (rng.choice(swarm).node_id,) if i % 2 else ()
        started = time.perf_counter()
        plan = plan_routes(swarm, MODEL, exclude=exclude, max_routes=1)
        times.append(time.perf_counter() - started)
        assert plan.best is not None, plan.describe_missing()
    started = time.perf_counter()
    plan_all(swarm, max_routes=3)
    whole = time.perf_counter() - started
    holders = statistics.mean(sum(n.start_layer <= layer <= n.end_layer for n in swarm) for layer in range(args.layers))
    print(f"planner: {args.nodes} nodes x {args.layers} layers, {holders:.0f} holders per layer, "
          f"{args.rtt_peers} measured round trips per node, {args.routes} routes")
    print(f"  per route: median {1000 * statistics.median(times):.1f} ms, p99 {1000 * percentile(times, 0.99):.1f} ms "
          f"(target < 50 ms); plan_all with 3 routes: {1000 * whole:.1f} ms")


# --------------------------------------------------------------------------- simulated nodes (client processes)


def simulate(args: argparse.Namespace) -> None:
    """One client process: nodes index % clients == part, until the tracker stops answering
    or ``--seconds`` + a margin have passed. Prints its counts on exit."""
    swarm = build_swarm(args.nodes, args.layers, args.rtt_peers, args.seed)[args.part::args.clients]
    ctx = zmq.Context()
    pongs = ctx.socket(zmq.ROUTER)
    pongs.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{pongs.bind_to_random_port('tcp://127.0.0.1')}"
    socks: dict[zmq.Socket, NodeInfo] = {}
    poller = zmq.Poller()
    poller.register(pongs, zmq.POLLIN)
    for node in swarm:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, node.node_id.encode())
        sock.connect(args.tracker)
        socks[sock] = replace(node, endpoint=endpoint)
        poller.register(sock, zmq.POLLIN)
        sock.send_multipart(p.encode(_register(socks[sock])))
    counts = {"acks": 0, "errors": 0, "registers": len(socks), "pongs": 0}
    rng = random.Random(args.part)
    due = {sock: time.monotonic() + rng.uniform(0, args.heartbeat) for sock in socks}
    deadline, stop = time.monotonic() + args.lifetime, []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # the bench is done: print the counts
    while time.monotonic() < deadline and not stop:
        for sock, _ in poller.poll(max(1, min(50, 1000 * (min(due.values()) - time.monotonic())))):
            if sock is pongs:
                identity, *frames = sock.recv_multipart()
                message, _ = p.decode(frames)
                sock.send_multipart([identity, *p.encode(p.Pong(nonce=message.nonce, node="sim"))])
                counts["pongs"] += 1
                continue
            _, body = p.split_envelope(sock.recv_multipart())
            reply, _ = p.decode(body)
            if isinstance(reply, p.Error) and reply.code == p.ErrorCode.UNKNOWN_NODE:
                sock.send_multipart(p.encode(_register(socks[sock])))
                counts["registers"] += 1
            counts["acks" if isinstance(reply, p.Ack) else "errors"] += 1
        now = time.monotonic()
        for sock, at in due.items():
            if at <= now:
                node = socks[sock]
                rtts = {peer: round(ms * rng.uniform(0.9, 1.1), 3) for peer, ms in node.rtts.items()}
                sock.send_multipart(p.encode(p.Heartbeat(node.node_id, sessions=node.sessions, queued=node.queued,
                                                         rtts=rtts)), zmq.NOBLOCK)
                due[sock] = at + args.heartbeat
    print(" ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    ctx.destroy(linger=0)


def _register(node: NodeInfo) -> p.Register:
    return p.Register(node_id=node.node_id, endpoint=node.endpoint, model=MODEL, fingerprint=FINGERPRINT,
                      num_layers=node.num_layers, start_layer=node.start_layer, end_layer=node.end_layer,
                      benchmark=node.benchmark, hardware={"device": "sim"})


# --------------------------------------------------------------------------- the tracker under load


def ask(sock: zmq.Socket, message: p.Message, timeout: float = 30.0) -> p.Message:
    sock.send_multipart(p.encode(message))
    if not sock.poll(timeout * 1000):
        raise RuntimeError(f"the tracker did not answer a {message.KIND.name} in {timeout:.0f} s")
    _, body = p.split_envelope(sock.recv_multipart())
    return p.decode(body)[0]


def bench_tracker(args: argparse.Namespace) -> None:
    tracker = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="swarm-scale-") as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", "fabric.cli", "--log-level", "warning", "tracker",
                                   "--bind", tracker, "--pub", f"tcp://127.0.0.1:{free_port()}",
                                   "--db", str(Path(tmp) / "ledger.sqlite3"), "--heartbeat", str(args.heartbeat)],
                                  cwd=REPO)]
        ctx = zmq.Context()
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(tracker)
        try:
            ask(client, p.Ping(1))
            started = time.monotonic()
            lifetime = str(args.seconds + 90)
            for part in range(args.clients):
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--simulate", str(part), "--tracker", tracker, "--lifetime", lifetime,
                     *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k in ("nodes", "layers", "rtt_peers", "clients", "heartbeat", "seed"))],
                    cwd=REPO, stdout=subprocess.PIPE, text=True))
            registered = lambda: len(ask(client, p.StatusRequest()).body["nodes"]) >= args.nodes  # noqa: E731
            if not wait_for(registered, timeout=90, interval=0.5):
                raise RuntimeError("not every simulated node registered in 90 s")
            print(f"tracker: {args.nodes} nodes registered in {time.monotonic() - started:.1f} s over "
                  f"{args.clients} client processes, heartbeats every {args.heartbeat:g} s")
            _route_latency(client, args)
        finally:
            client.close(linger=0)
            ctx.term()
            for proc in procs:
                proc.terminate()
            for proc in procs[1:]:
                out, _ = proc.communicate(timeout=30)
                print(f"  client: {out.strip()}")
            procs[0].wait(timeout=30)


def _route_latency(client: zmq.Socket, args: argparse.Namespace) -> None:
    times, errors = [], 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        reply = ask(client, p.RouteRequest(model=MODEL))
        times.append(time.perf_counter() - started)
        errors += not isinstance(reply, p.Route)
    nodes = ask(client, p.StatusRequest()).body["nodes"]
    stale = sum(n["last_seen_s"] > 2 * args.heartbeat for n in nodes)
    print(f"  route answers while {len(nodes)} nodes heartbeat: {len(times)} in {args.seconds:g} s, median "
          f"{1000 * statistics.median(times):.1f} ms, p99 {1000 * percentile(times, 0.99):.1f} ms, errors {errors}; "
          f"nodes last heard over 2 heartbeats ago: {stale}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--rtt-peers", type=int, default=32, help="measured round trips per node (at most 256)")
    parser.add_argument("--routes", type=int, default=200, help="routes the planner alone is timed on")
    parser.add_argument("--clients", type=int, default=2, help="processes simulating the nodes")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long routes are asked for under heartbeats")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds between a node's heartbeats")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-tracker", action="store_true", help="time the planner only")
    parser.add_argument("--simulate", type=int, default=None, help=argparse.SUPPRESS)  # a client process's part
    parser.add_argument("--tracker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate is not None:
        args.part = args.simulate
        simulate(args)
        return
    cpuinfo = Path("/proc/cpuinfo").read_text().split() if os.path.exists("/proc/cpuinfo") else []
    flags = sorted({f for f in cpuinfo if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")})
    print(f"cpu: {os.cpu_count()} cores, {' '.join(flags) or 'no avx2'}")
    bench_planner(args)
    if not args.no_tracker:
        bench_tracker(args)


if __name__ == "__main__":
    main()
