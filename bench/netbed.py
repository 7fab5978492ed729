#!/usr/bin/env python
"""meshnet across hosts: decode speed of a 3-node route whose processes sit on separate
hosts (network namespaces joined by links with delay), as ratios against the same route
on loopback, measured in the same run, and against the delay floor.

    python bench/netbed.py [--tiny] [--model REF] [--tokens N] [--reps R] [--max-wait S]
                           [--only 0ms|2ms|30ms/100Mbit] [--json OUT] [--keep-logs]

Needs root and ``ip netns`` (see tests/netbed.py). Configurations, run one after another:

- loopback: ``meshnet tracker`` and 3 ``meshnet node`` processes on 127.0.0.1 (tests/cluster.py's
  ProcessCluster), in this machine's own namespace;
- 0 ms: tracker, head, mid, tail and the client each on its own host, links without delay
  (what the namespaces and, without netem, the delay proxies cost by themselves);
- 2 ms: the same hosts, 2 ms one way on every host's link (so 4 ms one way, 8 ms round
  trip, between two hosts);
- 30 ms/100 Mbit: 30 ms one way and a 100 Mbit/s ``tbf`` limit on every host's link.

Nodes hold a third of the layers each (``fabric.wire.shard.even_split``) with 1 torch thread, as
``bench/fabric_bench.py`` runs a 3-node route on 2 cores. Every configuration is driven by
the same client agent process (tests/netbed_client.py; in the beds on its own host), which
timestamps each event. Decode tok/s = (tokens - 1) / (last token - first token), greedy,
after a warm-up; every run's token ids are compared with the loopback's. The machine is
shared: before each of the ``--reps`` runs the script waits (at most ``--max-wait`` s) until
other tenants use <= 15% of the CPU, and the median is over the runs they left that quiet
(over all runs when fewer than two were).

The delay floor: a decode step goes head -> mid -> tail -> head, three paths between hosts,
each delay(A) + delay(B) one way, i.e. 1.5 round trips per token (12 ms at 2 ms per link,
180 ms at 30 ms). The round trip is also measured (PING/PONG from the client to each node:
the same two links). Ideally ms/token = loopback ms/token + floor; "overhead" is the rest.
Delay comes from netem where the kernel has it, else from the userspace delay proxies
(tests/delay_proxy.py); the report says which.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fabric_bench import python_path  # noqa: E402
from tests import netbed  # noqa: E402
from tests.cluster import ProcessCluster  # noqa: E402

MESSAGES = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]
QUIET = 0.15  # a run is quiet when other tenants used at most this share of all cores
BEDS = {"0ms": dict(delay=0.0), "2ms": dict(delay=0.002), "30ms/100Mbit": dict(delay=0.030, rate="100mbit")}


def log(msg: str) -> None:
    print(f"[netbed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_meter():
    try:
        from bench.fabric_bench import LoadMeter
        return LoadMeter()
    except ImportError:  # psutil missing: no tenant figure
        return None


def wait_quiet(max_wait: float) -> None:
    """Wait (at most ``max_wait`` s) until other tenants use <= QUIET of the CPU for 1 s."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline and (meter := load_meter()) is not None:
        with meter:
            time.sleep(1.0)
        if meter.foreign <= QUIET:
            return


def decode(agent: netbed.Agent, model: str, tokens: int, reps: int, max_wait: float) -> dict:
    """Warm up once, then ``reps`` timed generations; tok/s from the client's timestamps.
    The median uses the runs other tenants left quiet when there are two, else all runs."""
    runs, ids = [], None
    for rep in range(reps + 1):
        if rep:
            wait_quiet(max_wait)
        meter = load_meter()
        if meter:
            meter.__enter__()
        events = list(agent.generate(model, MESSAGES, tokens, timeout=120))
        if meter:
            meter.__exit__(None, None, None)
        got = [t for e in events if e["event"] == "token" for t in e["ids"]]
        times = [e["t"] for e in events if e["event"] == "token"]
        ids = ids or got
        if rep:
            runs.append({"tok_s": (len(got) - 1) / (times[-1] - times[0]), "same_ids": got == ids,
                         "foreign_cpu": meter and round(meter.foreign, 3)})
    quiet = [r for r in runs if r["foreign_cpu"] is not None and r["foreign_cpu"] <= QUIET]
    used = quiet if len(quiet) >= 2 else runs
    return {"runs": runs, "ids": ids, "tok_s": statistics.median(r["tok_s"] for r in used),
            "quiet_runs": len(quiet), "route": [h["node"] for h in events[0]["route"]]}


def loopback(model: str, layers: list[str], work: Path, cache: Path, args) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    cluster = ProcessCluster(work, cache)
    agent = None
    try:
        for name, span in zip(("head", "mid", "tail"), layers):
            cluster.start_node(name, model, span)
        client_log = open(work / "client.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "tests.netbed_client", "--tracker", cluster.endpoint],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=client_log, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": python_path()})
        client_log.close()
        agent = netbed.Agent(proc, cluster.logs)
        agent.wait_nodes(["head", "mid", "tail"], model_id(model), timeout=600, procs=cluster.procs)
        result = decode(agent, model_id(model), args.tokens, args.reps, args.max_wait)
        result["rtt_ms"] = statistics.median(agent.ping(cluster.node_endpoints["head"], 20)) * 1e3
        return result
    finally:
        if agent:
            agent.close()
        cluster.close()


def in_namespaces(model: str, layers: list[str], work: Path, cache: Path, link: dict, args) -> dict:
    with netbed.Netbed(work, cache) as bed:
        for host in ("tracker", "head", "mid", "tail", "client"):
            bed.add_host(host, **link)
        bed.start_tracker("tracker")
        endpoints = [bed.start_node(name, model, span) for name, span in zip(("head", "mid", "tail"), layers)]
        with bed.client("client", timeout=120) as agent:
            agent.wait_nodes(["head", "mid", "tail"], model_id(model), timeout=600, procs=bed.procs)
            result = decode(agent, model_id(model), args.tokens, args.reps, args.max_wait)
            rtts = [r for e in endpoints for r in agent.ping(e, 10, timeout=10)]
        result["rtt_ms"] = statistics.median(rtts) * 1e3
        result["delay_by"] = "netem" if bed.netem else "delay proxy"
        return result


def model_id(model: str) -> str:
    from fabric.compute.models import resolve

    return resolve(model).model_id


def layer_spans(model: str, cache: Path) -> list[str]:
    from fabric.compute.models import load_config, resolve
    from fabric.wire.shard import even_split

    num_layers = load_config(resolve(model), cache / "meshnet").num_hidden_layers
    return [f"{s.start}-{s.end}" for s in even_split(num_layers, 3)]


def report(results: dict, args) -> dict:
    base = results["loopback"]
    base_ms = 1e3 / base["tok_s"]
    rows = {"loopback": {"tok_s": base["tok_s"], "ms_token": base_ms, "ratio_loopback": 1.0,
                         "quiet_runs": base["quiet_runs"],
                         "rtt_ms": base["rtt_ms"], "same_ids": all(r["same_ids"] for r in base["runs"])}}
    for name, link in BEDS.items():
        if name not in results:
            continue
        r = results[name]
        floor_ms = 3 * 2 * link["delay"] * 1e3  # three host-to-host paths, each two links, one way
        ms = 1e3 / r["tok_s"]
        rows[name] = {"tok_s": r["tok_s"], "ms_token": ms, "ratio_loopback": r["tok_s"] / base["tok_s"],
                      "floor_ms": floor_ms, "floor_tok_s": 1e3 / floor_ms if floor_ms else None,
                      "ratio_floor": r["tok_s"] * floor_ms / 1e3 if floor_ms else None,
                      "measured_floor_ms": 1.5 * r["rtt_ms"], "rtt_ms": r["rtt_ms"],
                      "overhead_ms": ms - base_ms - floor_ms, "delay_by": r["delay_by"], "quiet_runs": r["quiet_runs"],
                      "same_ids": r["ids"] == base["ids"] and all(x["same_ids"] for x in r["runs"])}
    print(f"\nmodel {args.model_label}, {args.tokens} new tokens, median of the quiet runs of {args.reps}, "
          f"3 nodes x 1 thread\n")
    print(f"{'configuration':<16}{'tok/s':>8}{'ms/tok':>8}{'x loopback':>11}{'RTT ms':>8}{'floor ms':>9}"
          f"{'floor tok/s':>12}{'x floor':>8}{'overhead ms':>12}  ids")
    for name, row in rows.items():
        cols = [(row["tok_s"], 8, ".2f"), (row["ms_token"], 8, ".1f"), (row["ratio_loopback"], 11, ".2f"),
                (row["rtt_ms"], 8, ".2f"), (row.get("floor_ms"), 9, ".1f"), (row.get("floor_tok_s"), 12, ".1f"),
                (row.get("ratio_floor"), 8, ".2f"), (row.get("overhead_ms"), 12, ".1f")]
        print(f"{name:<16}" + "".join(f"{'-' if v is None else format(v, f):>{w}}" for v, w, f in cols)
              + f"  {'same' if row['same_ids'] else 'DIFFER'}  {row['quiet_runs']}/{args.reps} quiet")
    delay_by = {r.get("delay_by") for r in rows.values()} - {None}
    print(f"\ndelay made by: {', '.join(delay_by) or '-'}; floor = 3 one-way host-to-host paths per token "
          f"(1.5 round trips); x floor = tok/s / floor tok/s\n")
    return rows


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")  # unwinds through every clean-up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model reference (default %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a 6-layer random llama (tests/tiny_models.py) instead")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per configuration (default %(default)s)")
    parser.add_argument("--max-wait", type=float, default=30.0,
                        help="seconds to wait for other tenants to quieten before each run (default %(default)s)")
    parser.add_argument("--only", choices=list(BEDS), default=None, help="one bed configuration")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory (logs) and print it")
    args = parser.parse_args(argv)
    if reason := netbed.unavailable():
        print(f"cannot build the test bed: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupt)
    work = Path(tempfile.mkdtemp(prefix="meshnet-netbed-bench-"))
    cache = work / "xdg-cache"
    cache.mkdir()
    try:
        model = args.model
        if args.tiny:
            from tests.tiny_models import make_model

            model = str(make_model("llama", work / "tiny-llama"))
        args.model_label = "tiny random llama (6 layers)" if args.tiny else model
        layers = layer_spans(model, cache)
        log(f"layers {layers}; work directory {work}")
        results = {}
        log("loopback")
        results["loopback"] = loopback(model, layers, work / "loopback", cache, args)
        for name, link in BEDS.items():
            if args.only in (None, name):
                log(f"namespaces, {name}")
                results[name] = in_namespaces(model, layers, work / name.replace("/", "-"), cache, link, args)
        rows = report(results, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model_label, "tokens": args.tokens, "reps": args.reps,
                                                   "figures": rows,
                                                   "runs": {k: v["runs"] for k, v in results.items()}}, indent=2))
        return 0 if all(r["same_ids"] for r in rows.values()) else 1
    finally:
        if args.keep_logs:
            log(f"logs kept in {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
