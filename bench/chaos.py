#!/usr/bin/env python
"""Chaos: steady load while heads, other nodes and the tracker are killed and restarted.

    python bench/chaos.py [--model smollm2-135m] [--clients 3] [--minutes 3] [--interval 12]
                          [--down 3] [--targets tail,head,tracker] [--tokens 40] [--seed 0]
                          [--quant-default] [--json OUT] [--logs DIR]

Starts, as real processes driven by the CLI, a tracker (with its ledger), two heads holding
the first half of the layers and two tails holding the second half (heartbeats at the
default interval), in exact mode
(``--dtype float32 --quant none``; ``--quant-default`` keeps the model's default mode). It
computes the reference answer of each prompt on the healthy swarm, then runs ``--clients``
threads, each streaming greedy requests through ``fabric.Client`` for ``--minutes``. Every
``--interval`` seconds one process of ``--targets`` chosen at random is stopped (SIGKILL
and SIGTERM in turn), kept down ``--down`` seconds and restarted; the next one goes only
once the swarm serves again, so one replica of each layer range is always up.

It reports requests done and failed (target 0), answers identical to the reference, the
worst gap between two tokens of a stream, the RSS growth of the processes that were never
restarted, and whether the ledger holds every completed request once with its token counts.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fabric import Client, FabricError  # noqa: E402
from fabric.compute.models import load_config, resolve  # noqa: E402
from fabric.node.leave import DRAIN_TIMEOUT  # noqa: E402
from fabric.wire.liveness import HEARTBEAT_INTERVAL  # noqa: E402
from tests.cluster import ProcessCluster  # noqa: E402

PROMPTS = ["Tell me a short story about a lighthouse keeper.", "What is the capital of France?",
           "Write a haiku about autumn rain.", "Explain what a CPU cache is, in two sentences.",
           "List three uses of copper.", "Why is the sky blue?"]
HEADS, TAILS = ("head1", "head2"), ("tail1", "tail2")
SLOW = 5.0  # a stream that waited this long for a token keeps its events in the --json output


@dataclass
class Outcome:
    prompt: int
    at: float = 0.0  # when it started (time.monotonic())
    request_id: str = ""
    ids: list[int] = field(default_factory=list)
    error: str = ""
    worst_gap: float = 0.0
    prompt_tokens: int = 0
    events: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds in, kind, head) of each event
    started: str = field(default_factory=lambda: time.strftime("%H:%M:%S"))  # wall clock, as in the logs


@dataclass
class Swarm:
    cluster: ProcessCluster
    model: str
    layers: int
    extra: tuple[str, ...]

    def start(self, name: str) -> None:
        if name == "tracker":
            self.cluster.start_tracker()
            return
        half = self.layers // 2
        layers = f"0-{half - 1}" if name in HEADS else f"{half}-{self.layers - 1}"
        self.cluster.start_node(name, self.model, layers, None, *self.extra)

    def serving(self, timeout: float = 180.0) -> bool:
        """Whether every process is up and the tracker plans a route, within ``timeout``."""
        try:
            self.cluster.wait_nodes([*HEADS, *TAILS], self.model_id, timeout)
            return True
        except AssertionError:
            return False

    @property
    def model_id(self) -> str:
        return Path(self.model).name if Path(self.model).exists() else self.model


def stream(client: Client, swarm: Swarm, prompt: int, tokens: int) -> Outcome:
    out, last = Outcome(prompt, time.monotonic()), None
    try:
        for event in client.generate(swarm.model_id, messages=[{"role": "user", "content": PROMPTS[prompt]}],
                                     max_tokens=tokens):
            out.request_id = event.request_id
            out.events.append((round(time.monotonic() - out.at, 2), str(event.event),
                               event.route[0].node if event.route else ""))
            if event.token_ids:
                now = time.monotonic()
                out.worst_gap = max(out.worst_gap, now - last) if last is not None else 0.0
                last = now
                out.ids.extend(event.token_ids)
            if event.prompt_tokens:
                out.prompt_tokens = event.prompt_tokens
    except FabricError as exc:
        out.error = str(exc)
    return out


def load(swarm: Swarm, clients: int, tokens: int, deadline: float, seed: int) -> list[Outcome]:
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        rng = random.Random(seed + i)
        with Client(swarm.cluster.endpoint, timeout=60) as client:
            while time.monotonic() < deadline:
                result = stream(client, swarm, rng.randrange(len(PROMPTS)), tokens)
                with lock:
                    outcomes.append(result)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def chaos(swarm: Swarm, targets: list[str], interval: float, down: float, deadline: float, seed: int,
          log: list[dict]) -> None:
    """Stop one process at a time, keep it down, restart it, wait until the swarm serves again."""
    rng, stops = random.Random(seed), 0
    names = {"head": HEADS, "tail": TAILS, "tracker": ("tracker",)}
    while time.monotonic() + interval < deadline:
        time.sleep(interval)
        victim = rng.choice(names[rng.choice(targets)])
        sig = signal.SIGKILL if stops % 2 == 0 else signal.SIGTERM
        stops += 1
        started = time.monotonic()
        log.append({"victim": victim, "signal": sig.name, "at": started})
        proc = swarm.cluster.procs[victim]
        try:  # a SIGTERM'd node finishes its sessions first, within its --drain-timeout
            swarm.cluster.kill(victim, sig, wait=DRAIN_TIMEOUT + 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            log[-1]["left_in_time"] = False
        log[-1]["exited_after_s"] = round(time.monotonic() - started, 1)
        time.sleep(down)
        swarm.start(victim)
        back = swarm.serving()
        log[-1] |= {"serving_again_s": round(time.monotonic() - started, 1), "recovered": back}


def note(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def rss(cluster: ProcessCluster) -> dict[str, tuple[int, int]]:
    """name -> (pid, RSS bytes) of every running process of the swarm."""
    rows = {}
    for name, proc in cluster.procs.items():
        try:
            rows[name] = (proc.pid, psutil.Process(proc.pid).memory_info().rss)
        except psutil.NoSuchProcess:
            pass
    return rows


def ledger_check(db: Path, done: list[Outcome]) -> dict:
    """Every completed request once in the ledger, with the token counts its client saw."""
    with sqlite3.connect(db) as conn:
        rows = {r: (p, c) for r, p, c in conn.execute(
            "SELECT request_id, prompt_tokens, completion_tokens FROM completions")}
    missing = [o.request_id for o in done if o.request_id not in rows]
    wrong = [o.request_id for o in done if o.request_id in rows and rows[o.request_id][1] != len(o.ids)]
    return {"recorded": sum(o.request_id in rows for o in done), "missing": len(missing),
            "wrong_counts": len(wrong), "examples": (missing + wrong)[:5]}


def references(swarm: Swarm, tokens: int) -> list[list[int]]:
    with Client(swarm.cluster.endpoint, timeout=120) as client:
        refs = [stream(client, swarm, i, tokens) for i in range(len(PROMPTS))]
    if any(r.error for r in refs):
        raise SystemExit(f"the healthy swarm failed a reference request: {[r.error for r in refs if r.error]}")
    return [r.ids for r in refs]


def summary(outcomes: list[Outcome], refs: list[list[int]], stops: list[dict], before: dict, after: dict,
            ledger: dict) -> dict:
    done = [o for o in outcomes if not o.error]
    growth = {name: after[name][1] - rss for name, (pid, rss) in before.items()
              if name in after and after[name][0] == pid}
    gaps = [o.worst_gap for o in done]
    for stop, end in zip(stops, [s["at"] for s in stops[1:]] + [float("inf")]):
        stop["failed_after"] = sum(1 for o in outcomes if o.error and stop["at"] <= o.at < end)
    return {"requests": len(outcomes), "done": len(done), "failed": len(outcomes) - len(done),
            "identical": sum(o.ids == refs[o.prompt] for o in done),
            "worst_token_gap_s": round(max(gaps, default=0.0), 2),
            "median_worst_gap_s": round(statistics.median(gaps), 3) if gaps else None,
            "errors": sorted({o.error for o in outcomes if o.error})[:5], "stops": stops,
            "rss_growth_mib": {k: round(v / 2**20, 1) for k, v in growth.items()}, "ledger": ledger}


def report(s: dict, args: argparse.Namespace) -> None:
    print(f"chaos on {args.model}: {args.clients} clients for {args.minutes} min, a stop every {args.interval} s "
          f"among {args.targets}")
    for stop in s["stops"]:
        print(f"  stopped {stop['victim']:<8} ({stop['signal']}, exited after {stop['exited_after_s']} s"
              + ("" if stop.get("left_in_time", True) else ", killed: it did not leave in time")
              + f"): serving again after {stop['serving_again_s']} s"
              + ("" if stop["recovered"] else " (NOT recovered)") + f", {stop['failed_after']} requests failed")
    met = s["failed"] == 0 and s["identical"] == s["done"]
    print(f"  requests {s['requests']}: done {s['done']}, failed {s['failed']} (target 0), identical to the "
          f"reference {s['identical']}/{s['done']}: {'met' if met else 'missed'}")
    for error in s["errors"]:
        print(f"    error: {error}")
    print(f"  worst gap between two tokens: {s['worst_token_gap_s']} s (median of each stream's worst: "
          f"{s['median_worst_gap_s']} s)")
    print(f"  RSS growth of processes never restarted: {s['rss_growth_mib'] or 'none survived'} MiB")
    led = s["ledger"]
    print(f"  ledger: {led['recorded']}/{s['done']} completed requests recorded once, {led['missing']} missing, "
          f"{led['wrong_counts']} with other token counts {led['examples'] or ''}")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The command line, and the kinds of process that may be stopped."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF or directory (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=3, help="concurrent streaming clients (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=3.0, help="how long the load runs (default: %(default)s)")
    parser.add_argument("--interval", type=float, default=12.0, help="seconds between stops (default: %(default)s)")
    parser.add_argument("--down", type=float, default=3.0, help="seconds a stopped process stays down "
                        "(default: %(default)s)")
    parser.add_argument("--targets", default="tail,head,tracker",
                        help="what may be stopped: tail, head, tracker (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=40, help="max_tokens of each request (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the choice of victims (default: %(default)s)")
    parser.add_argument("--quant-default", action="store_true", help="run nodes in the model's default mode, "
                        "not exact float32")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--logs", type=Path, help="copy every process's log into this folder at the end")
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    if not targets or set(targets) - {"tail", "head", "tracker"}:
        parser.error("--targets takes tail, head and tracker, comma separated")
    return args, targets


def load_under_chaos(swarm: Swarm, args: argparse.Namespace, targets: list[str], tmp: Path) -> tuple:
    """Runs the load on the serving swarm while processes are stopped and restarted; returns the
    outcomes, the reference answers, the stops, the RSS before and after, and the ledger's check."""
    refs = references(swarm, args.tokens)
    note("references taken; the load starts")
    before, stops = rss(swarm.cluster), []
    deadline = time.monotonic() + args.minutes * 60
    killer = threading.Thread(target=chaos, args=(swarm, targets, args.interval, args.down, deadline,
                                                  args.seed, stops), daemon=True)
    killer.start()
    outcomes = load(swarm, args.clients, args.tokens, deadline, args.seed)
    note(f"load ended ({len(outcomes)} requests)")
    killer.join()
    after = rss(swarm.cluster)
    note("the swarm serves again" if swarm.serving() else "the swarm did NOT serve again")
    time.sleep(2.0)  # the heads' final reports reach a restarted tracker
    ledger = ledger_check(tmp / "ledger.sqlite3", [o for o in outcomes if not o.error])
    return outcomes, refs, stops, before, after, ledger


def write_json(args: argparse.Namespace, s: dict, outcomes: list[Outcome]) -> None:
    """Writes the arguments, the summary and every request's outcome (events only of slow streams) to ``--json``."""
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    rows = [asdict(o) | {"ids": len(o.ids), "events": o.events if o.worst_gap > SLOW else []} for o in outcomes]
    args.json.write_text(json.dumps({"args": given, **s, "outcomes": rows}, indent=1))


def main() -> int:
    args, targets = parse_args()
    extra = () if args.quant_default else ("--dtype", "float32", "--quant", "none")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ProcessCluster(Path(tmp), Path(tmp) / "cache", heartbeat=HEARTBEAT_INTERVAL)  # as a user runs it
        swarm = Swarm(cluster, args.model, load_config(resolve(args.model)).num_hidden_layers, extra)
        try:
            for name in (*HEADS, *TAILS):
                swarm.start(name)
            if not swarm.serving(300):
                raise SystemExit("the swarm did not come up:\n" + cluster.logs())
            outcomes, refs, stops, before, after, ledger = load_under_chaos(swarm, args, targets, Path(tmp))
        finally:
            cluster.close()
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                for log in Path(tmp).glob("*.log"):
                    shutil.copy(log, args.logs / log.name)
    s = summary(outcomes, refs, stops, before, after, ledger)
    report(s, args)
    if args.json:
        write_json(args, s, outcomes)
    return 0 if s["failed"] == 0 and s["identical"] == s["done"] else 1


if __name__ == "__main__":
    sys.exit(main())
