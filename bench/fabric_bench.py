#!/usr/bin/env python
"""meshnet fabric benchmark: every figure is a ratio against a baseline measured in the same run.

    python bench/fabric_bench.py [--quick] [--tokens N] [--reps R] [--json OUT]
                                 [--tries K] [--max-wait S] [--budget MIN] [--keep-logs]
                                 [--device cpu|cuda] [--dtype float32|bfloat16]

1. Decode tokens/s: single-process transformers (``AutoModelForCausalLM.from_pretrained(dir,
   gguf_file=...)``, greedy ``generate``, same dtype, device and thread count) against the fabric with
   1, 2 and 3 nodes on loopback, started and driven exactly as users do: ``python -m
   fabric.cli tracker ...`` and ``python -m fabric.cli node ... --compute-lock F``
   subprocesses (even split, no ``--threads``: every core, one-token passes on one where the
   node finds that no slower; one lock file F per cluster, as ``meshnet up``), then ``fabric.Client(tracker).generate(model, messages=..., max_tokens=N)``; decode tok/s is timed from the first
   token event to the done event (transformers: first streamed token to the end). The
   fabric's greedy token ids are checked against the single process's.
2. Added latency per hop against a raw pyzmq DEALER->ROUTER echo round trip of one hidden
   state (hidden_size values of the dtype, 2304 B for SmolLM2-135M in float32). Diagnostic clusters run the
   same CLI through ``bench/trace_node.py``, which timestamps layer compute, frame
   receipt/decode, forwarding, sampling and the head's token handling (CLOCK_MONOTONIC is
   shared by all processes). Per decode step, "non-compute" = per-token time minus layer
   compute, on the critical path; added per hop = non-compute of a 2-node route minus that
   of a 1-node route (both 1 thread per node). A 2-node route adds exactly one round trip
   per token (hidden state out, token back), hence the comparison with a raw round trip.
   Cross-check: per-token time of the traced 2-node minus 1-node cluster.
3. Resident memory (psutil RSS, and USS, after load and after one generation) of a node
   holding half of the layers (0-14) against a full node (0-29), plus the RSS of a bare
   interpreter that imported what a node imports (the runtime floor).

Noise. The machine is shared. Configurations run in rotating order, ``--reps`` times each.
Before each timed run the benchmark waits (at most ``--max-wait`` s) until other tenants
use <= 15% of the CPU; a thread watches them during the run and cuts it short if they
take > 30% for 2 s (a contended 2-thread process slows down tenfold); a disturbed run is
retried up to ``--tries`` times. Medians use the quiet runs (>= 2 of them), else all runs
(marked). After ``--budget`` minutes runs are no longer gated or retried.

All subprocesses are stopped on exit, on Ctrl-C and on SIGTERM (SIGTERM, then SIGKILL);
on Linux they also get SIGTERM should this process die. With ``--json`` an interrupted run
still writes what it measured.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from concurrency import add_device_args, device_args  # noqa: E402

from tests.support import free_port  # noqa: E402

PROMPT = ({"role": "user", "content": "Explain in a few sentences why the sky is blue."},)
TARGETS = {"two_node_ratio": 0.95, "hop_ratio": 1.5, "memory_ratio": 0.6}
QUIET = 0.15  # a timed run is "quiet" when other tenants used at most this share of all cores
MIN_QUIET = 2  # medians use the quiet runs when there are at least this many, else every run (flagged)


def python_path(repo: Path = REPO) -> str:
    """PYTHONPATH for subprocesses: the repository (``repo``: another checkout's code) first, then
    whatever the caller had set."""
    return os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))


def _relative(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (results name no local folders)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# --------------------------------------------------------------------------- processes


def _pdeathsig():
    """Preexec hook: the child gets SIGTERM if this process dies (Linux), so nothing is orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Procs:
    """Every subprocess this run starts, with its log file; stop() is idempotent."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.items: list[tuple[str, subprocess.Popen, Path]] = []
        self._preexec = _pdeathsig() if sys.platform.startswith("linux") else None

    def start(self, name: str, argv: list[str], env: dict | None = None, repo: Path = REPO) -> subprocess.Popen:
        """Start ``argv`` from checkout ``repo`` (its code runs), ``env`` added to this process's."""
        logfile = self.logdir / f"{name}.log"
        with open(logfile, "wb") as out:
            proc = subprocess.Popen(argv, cwd=repo, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONPATH": python_path(repo), **(env or {})},
                                    start_new_session=True, preexec_fn=self._preexec)
        self.items.append((name, proc, logfile))
        return proc

    def tail(self, proc: subprocess.Popen, lines: int = 15) -> str:
        for _, p, logfile in self.items:
            if p is proc:
                return "\n".join(logfile.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, procs: list[subprocess.Popen] | None = None, grace: float = 15.0) -> None:
        targets = [p for _, p, _ in self.items if procs is None or p in procs]
        for p in targets:
            if p.poll() is None:
                try:
                    p.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in targets:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------- load meter


class LoadMeter:
    """CPU used by other tenants of the machine while a measurement runs (0..1 of all cores):
    everything but ``pids`` (default: this process) and their children."""

    def __init__(self, pids: list[int] | None = None):
        self.procs = [psutil.Process(pid) for pid in pids] if pids else [psutil.Process()]

    def _mine(self) -> float:
        total = 0.0
        for proc in self.procs:
            try:
                for p in [proc, *proc.children(recursive=True)]:
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def __enter__(self):
        self.t0, self.sys0, self.mine0 = time.monotonic(), psutil.cpu_times(), self._mine()
        return self

    def __exit__(self, *exc):
        wall = max(time.monotonic() - self.t0, 1e-9)
        sys1, mine1 = psutil.cpu_times(), self._mine()
        idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        steal = lambda t: getattr(t, "steal", 0.0)  # noqa: E731
        busy = (sum(sys1) - idle(sys1) - steal(sys1)) - (sum(self.sys0) - idle(self.sys0) - steal(self.sys0))
        cap = wall * (psutil.cpu_count() or 1)
        self.mine = mine1 - self.mine0  # CPU seconds of ``pids`` and their children
        self.foreign = max(0.0, (busy - self.mine) / cap)
        self.steal = max(0.0, (steal(sys1) - steal(self.sys0)) / cap)
        return False


class NoiseWatch:
    """Watches other tenants' CPU use during a timed run, in a thread; ``abort`` is set when
    they use more than ``limit`` of all cores for ``patience`` windows in a row, so a run that
    is being spoiled (a contended 2-thread process can slow down tenfold) is cut short."""

    def __init__(self, enabled: bool, limit: float = 2 * QUIET, window: float = 1.0, patience: int = 2):
        import threading

        self.abort = threading.Event()
        self._stop = threading.Event()
        self._args = (limit, window, patience)
        self._thread = threading.Thread(target=self._run, daemon=True) if enabled else None

    def _run(self) -> None:
        limit, window, patience = self._args
        strikes = 0
        while not self._stop.is_set():
            with LoadMeter() as meter:
                self._stop.wait(window)
            strikes = strikes + 1 if meter.foreign > limit else 0
            if strikes >= patience:
                self.abort.set()
                return

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()
        return False


# --------------------------------------------------------------------------- clusters


@dataclass
class Cluster:
    key: str  # e.g. "fabric-2"
    label: str
    shards: list  # fabric.wire.shard.Shard
    threads: int | str  # "auto": no --threads, as `meshnet up` (every core; one-token passes on one where no slower)
    traced: bool = False  # diagnostic: nodes run bench/trace_node.py (same CLI, timing hooks)
    profile_dir: Path | None = None
    repo: Path = REPO  # the checkout whose code its processes run
    env: dict = field(default_factory=dict)  # added to its processes' environment
    machines: bool = False  # each node on a core and a compute lock of its own, as if on a machine of its own
    tracker: str = ""
    tracker_proc: subprocess.Popen | None = None
    nodes: list = field(default_factory=list)  # [(shard, Popen, trace path | None)]
    rss_load: list = field(default_factory=list)  # per node (rss, uss) bytes
    rss_gen: list = field(default_factory=list)
    ready: bool = False
    failed: bool = False  # every warm-up generation failed, or a process of it died
    lost: list = field(default_factory=list)  # processes that exited during the run: (args, code)

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [self.tracker_proc, *(p for _, p, _ in self.nodes)]

    def layout(self) -> str:
        return " | ".join(str(s) for s in self.shards)


def checkout_up_flags(repo: Path, model: str, extra: tuple[str, ...], nodes: int) -> list[str]:
    """What `meshnet up` adds to its nodes' flags, as checkout ``repo``'s own code says: none since its
    nodes choose their decode threads themselves (``hops.decodes_at_once``); a checkout from before
    that gives what its ``concurrency.up_flags`` says, one from before such flags existed none."""
    if repo == REPO or not (repo / "bench" / "concurrency.py").is_file():
        return []
    code = ("import json, sys; from concurrency import up_flags; "
            "print(json.dumps(up_flags(*json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([model, list(extra), nodes])], cwd=repo / "bench",
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "bench"), python_path(repo)])})
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []


def start_cluster(procs: Procs, c: Cluster, model: str, tmp: Path, extra: tuple[str, ...] = ()) -> None:
    """Start ``c``'s tracker and nodes; ``extra`` goes to every node (``--device``, ``--dtype``)."""
    py = sys.executable
    port, pub = free_port(), free_port()
    c.tracker = f"tcp://127.0.0.1:{port}"
    c.tracker_proc = procs.start(f"{c.key}-tracker", [
        py, "-m", "fabric.cli", "--log-level", "warning", "tracker", "--bind", c.tracker,
        "--pub", f"tcp://127.0.0.1:{pub}", "--db", str(tmp / f"{c.key}-ledger.db")], c.env, c.repo)
    threads = ["--threads", str(c.threads)] if c.threads != "auto" else checkout_up_flags(c.repo, model, extra,
                                                                                         len(c.shards))
    for i, shard in enumerate(c.shards):
        lock = tmp / (f"{c.key}-{i}.lock" if c.machines else f"{c.key}.lock")
        node_args = ["node", "--model", model, "--layers", str(shard), "--tracker", c.tracker, *threads,
                     "--compute-lock", str(lock), "--no-progress", *extra]
        env, trace = dict(c.env), None
        if c.traced or c.profile_dir:
            argv = [py, str(c.repo / "bench" / "trace_node.py"), "--log-level", "warning", *node_args]
            if c.profile_dir:
                env["MESHNET_BENCH_PROFILE"] = str(c.profile_dir / f"{c.key}-node{i}-{shard}.prof")
            else:
                trace = tmp / f"{c.key}-node{i}.jsonl"
                env["MESHNET_BENCH_TRACE"] = str(trace)
        else:
            argv = [py, "-m", "fabric.cli", "--log-level", "warning", *node_args]
        if c.machines:
            argv = ["taskset", "-c", str(sorted(os.sched_getaffinity(0))[i % len(os.sched_getaffinity(0))]), *argv]
        c.nodes.append((shard, procs.start(f"{c.key}-node{i}-{shard}", argv, env, c.repo), trace))


def memory(proc: subprocess.Popen) -> tuple[int, int]:
    p = psutil.Process(proc.pid)
    try:
        return p.memory_info().rss, p.memory_full_info().uss
    except psutil.AccessDenied:
        return p.memory_info().rss, 0


FLOOR = """
import psutil, torch, transformers
from transformers import AutoModelForCausalLM, LlamaForCausalLM
import fabric.node
print(psutil.Process().memory_info().rss)
"""


def runtime_floor() -> int | None:
    """RSS of a python that imported what a node imports, before any weights."""
    try:
        out = subprocess.run([sys.executable, "-c", FLOOR], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": python_path()})
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def wait_ready(procs: Procs, clusters: list[Cluster], model: str, timeout: float = 900.0) -> None:
    from fabric import Client, FabricError

    deadline = time.monotonic() + timeout
    pending = [c for c in clusters if not c.ready]
    while pending:
        for c in list(pending):
            for proc in c.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{c.label}: a process exited with {proc.returncode}:\n{procs.tail(proc)}")
            try:
                with Client(c.tracker, timeout=2.0) as client:
                    status = client.status()
            except FabricError:
                continue
            plans = status.get("plans", {}).get(model) or []
            if len(status.get("nodes", [])) == len(c.shards) and plans and len(plans[0]["hops"]) == len(c.shards):
                c.ready = True
                c.rss_load = [memory(p) for _, p, _ in c.nodes]
                pending.remove(c)
                log(f"{c.label} ready")
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"clusters not ready after {timeout:.0f}s: {[c.label for c in pending]}")
            time.sleep(0.5)


def fabric_generate(c: Cluster, model: str, n_tokens: int, strict: bool = False, abort=None) -> dict:
    """One generation through the tracker and the head, as a user's script does it.

    A request the fabric fails (``FabricError``) is returned with ``error`` set, so one bad
    run is counted and reported instead of ending the benchmark; ``strict`` raises instead.
    """
    from fabric import Client, FabricError

    request_id = uuid.uuid4().hex
    ids: list[int] = []
    t_start = time.perf_counter()
    t_first = t_done = None
    route, error, aborted = (), None, False
    try:
        with Client(c.tracker, timeout=120.0) as client:
            events = client.generate(model, messages=list(PROMPT), max_tokens=n_tokens, request_id=request_id)
            for event in events:
                if abort is not None and abort.is_set():
                    aborted = True
                    events.close()  # cancels the request along the route
                    break
                t = time.perf_counter()
                if event.event == "token" and event.token_ids:
                    if t_first is None:
                        t_first = t
                    ids.extend(event.token_ids)
                elif event.event == "done":
                    t_done, route = t, event.route
    except FabricError as exc:
        if strict:
            raise
        error = f"{exc} (after {len(ids)} tokens, {time.perf_counter() - t_start:.1f}s)"
        log(f"{c.label}: the fabric failed the request: {error}")
    if error is None and not aborted and len(route) != len(c.shards):
        error = f"the route had {len(route)} hops, expected {len(c.shards)}"
    n = len(ids)
    ok = error is None and not aborted and n > 1 and t_done > t_first
    return {"ids": ids, "tokens": n, "ttft_s": (t_first - t_start) if t_first else None, "request_id": request_id,
            "decode_tps": (n - 1) / (t_done - t_first) if ok else None, "error": error, "aborted": aborted}


# --------------------------------------------------------------------------- baseline


def clock_streamer():
    """A transformers streamer that timestamps every generated token (``times``) and the end."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.prompt_seen, self.times, self.end_t = False, [], None

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True  # the first put is the prompt
                return
            self.times.append(time.perf_counter())

        def end(self):
            self.end_t = time.perf_counter()

    return Clock()


class Baseline:
    """The model in this process, loaded the way the brief says, run with ``generate``."""

    def __init__(self, source, tokenizer, eos: list[int], dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.gguf_file,
                                                          dtype=getattr(torch, dtype)).to(device).eval()
        ids = tokenizer.apply_chat_template(list(PROMPT), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        self.input_ids = torch.tensor([list(ids)], dtype=torch.int64, device=device)
        self.eos = eos
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]

    def generate(self, n_tokens: int, threads: int, abort=None) -> dict:
        from transformers import StoppingCriteria, StoppingCriteriaList
        torch = self.torch

        class Abort(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), bool(abort is not None and abort.is_set()),
                                  dtype=torch.bool, device=input_ids.device)

        torch.set_num_threads(threads)
        clock = clock_streamer()
        t_start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(self.input_ids, attention_mask=torch.ones_like(self.input_ids),
                                      max_new_tokens=n_tokens, do_sample=False, eos_token_id=self.eos,
                                      pad_token_id=self.pad, streamer=clock,
                                      stopping_criteria=StoppingCriteriaList([Abort()]))
        ids = out[0, self.input_ids.shape[1]:].tolist()
        n = len(clock.times)
        aborted = bool(abort is not None and abort.is_set()) and len(ids) < n_tokens and ids[-1] not in self.eos
        return {"ids": ids, "tokens": len(ids), "ttft_s": clock.times[0] - t_start, "aborted": aborted,
                "error": None,
                "decode_tps": (n - 1) / (clock.end_t - clock.times[0]) if n > 1 and not aborted else None}


# --------------------------------------------------------------------------- raw zmq round trip

ECHO = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(sys.argv[1])
while True:
    s.send_multipart(s.recv_multipart(copy=False), copy=False)
"""


class RawRTT:
    """DEALER (here) -> ROUTER echo (another process) round trips of one hidden state's bytes."""

    def __init__(self, procs: Procs, nbytes: int):
        import zmq

        self.zmq = zmq
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc = procs.start("raw-echo", [sys.executable, "-c", ECHO, self.endpoint])
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self.payload = os.urandom(nbytes)
        self.blocks: list[dict] = []
        self.sock.send(self.payload)
        if not self.sock.poll(30_000):
            raise RuntimeError("the raw echo process did not answer")
        self.sock.recv()
        self.measure(200, keep=False)  # warm up

    def measure(self, n: int, keep: bool = True) -> float:
        send, recv, clock = self.sock.send, self.sock.recv, time.perf_counter_ns
        payload, out = self.payload, []
        with LoadMeter() as meter:
            for _ in range(n):
                t0 = clock()
                send(payload)
                recv()
                out.append((clock() - t0) / 1e3)
        if keep:
            self.blocks.append({"median_us": statistics.median(out), "foreign_load": meter.foreign,
                                "quiet": meter.foreign <= QUIET, "samples": out})
        return statistics.median(out)

    def measure_paced(self, n: int, gap: float) -> dict:
        """Round trips with both ends idle ``gap`` s before each, as a node idles while the
        other computes a decode step: the wake-up from that idleness is part of every hop."""
        out = []
        with LoadMeter() as meter:
            for _ in range(n):
                time.sleep(gap)
                t0 = time.perf_counter_ns()
                self.sock.send(self.payload)
                self.sock.recv()
                out.append((time.perf_counter_ns() - t0) / 1e3)
        return {"gap_ms": gap * 1e3, "median_us": median(out), "p90_us": _pct(out, 90), "n": n,
                "foreign_load": meter.foreign}

    def summary(self) -> dict:
        quiet = [b for b in self.blocks if b["quiet"]]
        use = quiet or self.blocks
        xs = [x for b in use for x in b["samples"]]
        return {"bytes": len(self.payload), "median_us": median(xs), "p10_us": _pct(xs, 10), "p90_us": _pct(xs, 90),
                "n": len(xs), "quiet_blocks": len(quiet), "blocks": len(self.blocks),
                "block_medians_us": [round(b["median_us"], 1) for b in self.blocks],
                "block_foreign_load": [round(b["foreign_load"], 3) for b in self.blocks]}


# --------------------------------------------------------------------------- traces


def load_trace(path: Path) -> dict[str, list]:
    by_kind: dict[str, list] = {}
    if not path or not path.is_file():
        return by_kind
    for line in path.read_text().splitlines():
        e = json.loads(line)
        by_kind.setdefault(e[0], []).append(e)
    for events in by_kind.values():
        events.sort(key=lambda e: e[-2] if e[0] in ("run", "inbound", "forward", "reply", "sample", "on_token", "after")
                    else e[-1])
    return by_kind


def _t0(e) -> int:
    return e[-1] if e[0] == "dispatch" else e[-2]


def _last_before(events: list, t: int):
    """The latest event starting at or before t."""
    keys = [_t0(e) for e in events]
    i = bisect_right(keys, t) - 1
    return events[i] if i >= 0 else None


def traced_sessions(runs: list[dict], skip: int = 1) -> list[str]:
    """The sessions every node of a traced cluster computed, in the order the head began them,
    less the first ``skip`` (the warm-up). A head names a route session itself (a request's id
    is the client's), so the timed sessions are read from the trace."""
    everywhere = set.intersection(*({session for session, _ in r} for r in runs)) - {"__bench__"}
    first: dict[str, int] = {}
    for (session, _), e in runs[0].items():
        if session in everywhere:
            first[session] = min(first.get(session, e[6]), e[6])
    return sorted(first, key=first.get)[skip:]


def _step_row(runs: list[dict], traces: list[dict], s: str, pos: int) -> dict | None:
    """One decode step of session ``s`` at ``pos`` (µs): compute per node, forward legs, return leg and,
    where the hooks allow, the finer split of the first forward leg and of the return leg; None when a
    node lacks that step or the head the next one."""
    if (s, pos + 1) not in runs[0] or not all((s, pos) in r for r in runs):
        return None
    head, tail = traces[0], traces[-1]
    steps = [r[(s, pos)] for r in runs]
    nxt = runs[0][(s, pos + 1)]
    row = {"compute": [(e[7] - e[6]) / 1e3 for e in steps],
           "forward_legs": [(steps[i + 1][6] - steps[i][7]) / 1e3 for i in range(len(steps) - 1)],
           "return_leg": (nxt[6] - steps[-1][7]) / 1e3,
           "per_token": (nxt[6] - steps[0][6]) / 1e3}
    # finer split of the first forward leg and of the return leg, where the hooks allow
    if len(steps) > 1:
        fwd = _last_before([e for e in head.get("forward", []) if not e[3]], steps[1][6])
        inb = _last_before(traces[1].get("inbound", []), steps[1][6])
        dsp = _last_before(traces[1].get("dispatch", []), steps[1][6])
        if fwd and inb and dsp and fwd[4] >= steps[0][7]:
            row["fwd_encode_send"] = (fwd[5] - fwd[4]) / 1e3
            row["fwd_wire_wake"] = (inb[1] - fwd[5]) / 1e3
            row["fwd_decode"] = (dsp[-1] - inb[1]) / 1e3
            row["fwd_queue"] = (steps[1][6] - dsp[-1]) / 1e3
    smp = _last_before(tail.get("sample", []), nxt[6])
    tok = _last_before(head.get("on_token", []), nxt[6])
    if smp and tok and smp[1] >= steps[-1][7] and tok[3] >= smp[2]:
        row["ret_sample"] = (smp[2] - smp[1]) / 1e3
        if len(steps) > 1:
            inb = _last_before(head.get("inbound", []), tok[3])
            dsp = _last_before(head.get("dispatch", []), tok[3])
            if inb and dsp and inb[1] >= smp[2]:
                row["ret_send_wire_wake"] = (inb[1] - smp[2]) / 1e3
                row["ret_decode"] = (dsp[-1] - inb[1]) / 1e3
                row["ret_dispatch"] = (tok[3] - dsp[-1]) / 1e3
        else:
            row["ret_send_local"] = (tok[3] - smp[2]) / 1e3
        row["ret_on_token"] = (tok[4] - tok[3]) / 1e3
        row["ret_emit_loop"] = (nxt[6] - tok[4]) / 1e3
    return row


def hop_breakdown(c: Cluster) -> dict:
    """Per decode step of the timed sessions: compute per node, forward legs, return leg (µs)."""
    traces = [load_trace(trace) for _, _, trace in c.nodes]
    if not traces or not all(t.get("run") for t in traces):
        return {}
    runs = [{(e[1], e[2]): e for e in t["run"]} for t in traces]
    rows = []
    for s in traced_sessions(runs):
        positions = sorted(pos for (sess, pos), e in runs[0].items() if sess == s and e[3] == 1)
        for pos in positions:
            row = _step_row(runs, traces, s, pos)
            if row is not None:
                rows.append(row)
    if not rows:
        return {}
    keys = sorted({k for r in rows for k in r if k not in ("compute", "forward_legs")})
    out = {"steps": len(rows),
           "compute_us": [median([r["compute"][i] for r in rows]) for i in range(len(c.shards))],
           "forward_legs_us": [median([r["forward_legs"][i] for r in rows]) for i in range(len(c.shards) - 1)],
           "overhead_us": median([sum(r["forward_legs"]) + r["return_leg"] for r in rows])}
    out.update({f"{k}_us": median([r.get(k) for r in rows]) for k in keys})
    return out


# --------------------------------------------------------------------------- the run


class Gate:
    """Quiet gating: wait (bounded) for other tenants to calm down before a timed run, and
    retry a run that they disturbed anyway, until the run's time budget is spent."""

    def __init__(self, tries: int, max_wait: float, budget_s: float):
        self.tries, self.max_wait = tries, max_wait
        self.deadline = time.monotonic() + budget_s

    @property
    def spent(self) -> bool:
        return time.monotonic() > self.deadline

    def wait_quiet(self) -> float:
        limit = min(self.deadline, time.monotonic() + self.max_wait)
        while True:
            with LoadMeter() as meter:
                time.sleep(1.0)
            if meter.foreign <= QUIET or time.monotonic() > limit:
                return meter.foreign


def _dead(c: Cluster) -> bool:
    """A process of the cluster exited (other tenants' clean-ups have killed processes named
    like ours): the cluster is reported as failed and left out of the remaining runs."""
    gone = [(p.args[3:5] if len(p.args) > 4 else p.args, p.returncode) for p in c.procs if p.poll() is not None]
    if gone:
        c.failed = True
        c.lost = gone
        log(f"{c.label}: process(es) exited from outside the benchmark: {gone}; left out of the remaining runs")
    return bool(gone)


def measure_round(jobs: list[tuple], base: Baseline, model: str, n_tokens: int, rep: int, results: dict,
                  raw: RawRTT, gate: Gate) -> None:
    shift = rep % len(jobs)
    for kind, key, arg in jobs[shift:] + jobs[:shift]:
        if kind == "fabric" and (arg.failed or _dead(arg)):
            continue
        for attempt in range(gate.tries):
            if not gate.spent:
                gate.wait_quiet()
            last = attempt == gate.tries - 1
            with NoiseWatch(enabled=not gate.spent and not last) as watch, LoadMeter() as meter:
                r = (base.generate(n_tokens, arg, watch.abort) if kind == "baseline"
                     else fabric_generate(arg, model, n_tokens, abort=watch.abort))
            r.update(foreign_load=meter.foreign, steal=meter.steal, rep=rep, attempt=attempt,
                     quiet=meter.foreign <= QUIET and r.get("error") is None and not r.get("aborted"))
            results.setdefault(key, []).append(r)
            tps = f"{r['decode_tps']:.2f}" if r["decode_tps"] else "n/a"
            state = ("" if r["quiet"] else ", FAILED" if r.get("error") else ", cut short" if r.get("aborted")
                     else ", noisy")
            log(f"rep {rep + 1}.{attempt + 1}: {key:<18} {tps:>7} tok/s  ({r['tokens']} tokens, other tenants "
                f"{meter.foreign:.0%} CPU{state})")
            if r["quiet"] or gate.spent:
                break
    if not gate.spent:
        gate.wait_quiet()
    raw.measure(1000)


def _report_header(args, state: dict, cores: int, num_layers: int, hidden: int, tmp: Path) -> dict:
    """The run's report, kept in ``state`` (an interrupted run writes it), with what ran on what."""
    import torch
    import transformers

    report: dict = state.setdefault("report", {})
    report.update({
        "command": " ".join([Path(sys.executable).name, _relative(sys.argv[0]), *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {"cores": cores, "cpu": _cpu_name(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "model": args.model, "device": _device_name(args.device), "dtype": args.dtype, "layers": num_layers,
        "hidden": hidden, "tokens": args.tokens, "reps": args.reps,
        "quiet_threshold": QUIET, "tries": args.tries, "logs": str(tmp),
    })
    return report


def _phase_a(args, procs: Procs, main: list[Cluster], base: Baseline, cores: int, results: dict, raw: RawRTT,
             gate: Gate) -> dict:
    """Phase A, what users run (threads per node as `meshnet up` assigns them): waits for the started
    ``main`` clusters, warms them up, times them against the baseline and stops them; returns the
    baseline's warm-up generation (the reference token ids)."""
    wait_ready(procs, main, args.model_id)
    reference = base.generate(args.tokens, cores)  # warm-up and the reference token ids
    results[f"baseline-{cores}t-warmup"] = [reference]
    for c in main:
        warm_up(c, args, results)
    jobs = [("baseline", f"baseline-{cores}t", cores)] + [("fabric", c.key, c) for c in main if not c.failed]
    for rep in range(args.reps):
        measure_round(jobs, base, args.model_id, args.tokens, rep, results, raw, gate)
    procs.stop([p for c in main for p in c.procs])
    return reference


def _phase_b(args, procs: Procs, tmp: Path, extra, base: Baseline, num_layers: int, cores: int, results: dict,
             raw: RawRTT, gate: Gate) -> list[Cluster]:
    """Phase B, traced diagnostic clusters with equal thread counts for the per-hop breakdown: starts,
    warms up, times and stops them (their nodes write their traces on exit); returns the clusters."""
    from fabric.wire.shard import even_split

    diag = [Cluster("diag-1n-1t", "traced 1 node, 1 thread", even_split(num_layers, 1), 1, traced=True),
            Cluster("diag-2n-1t", "traced 2 nodes, 1 thread each", even_split(num_layers, 2), 1, traced=True)]
    if not args.quick and cores > 1:
        diag.append(Cluster(f"diag-2n-{cores}t", f"traced 2 nodes, {cores} threads each",
                            even_split(num_layers, 2), cores, traced=True))
    for c in diag:
        start_cluster(procs, c, args.model, tmp, extra)
    wait_ready(procs, diag, args.model_id)
    results["baseline-1t-warmup"] = [base.generate(args.tokens, 1)]
    for c in diag:
        warm_up(c, args, results)
    jobs = [("baseline", "baseline-1t", 1)] + [("fabric", c.key, c) for c in diag if not c.failed]
    if len(diag) > 2:
        jobs.insert(1, ("baseline", f"baseline-{cores}t-diag", cores))
    for rep in range(args.reps):
        measure_round(jobs, base, args.model_id, args.tokens, args.reps + rep, results, raw, gate)
    procs.stop([p for c in diag for p in c.procs])  # the traced nodes write their traces on exit
    return diag


def _finish_report(args, report: dict, cores, main, diag, results, reference, raw: RawRTT, half) -> None:
    """Adds the analysis to ``report``, with the raw round trip paced like a 2-node decode step and the
    memory above the runtime floor."""
    two = [r["decode_tps"] for r in results.get("diag-2n-1t", []) if r.get("decode_tps")]
    paced = raw.measure_paced(100 if args.quick else 300, 0.5 / median(two)) if two else None
    report.update(analyse(args, cores, main, diag, results, reference, raw, half))
    report["raw_rtt"]["paced"] = paced
    if paced and report["summary"]["hop_added_us"] is not None:
        report["summary"]["hop_ratio_paced"] = report["summary"]["hop_added_us"] / paced["median_us"]
    report["memory"]["runtime_floor_rss"] = floor = runtime_floor()
    for m in report["memory"].values():
        if isinstance(m, dict) and floor and m["full_rss"] and m["half_rss"]:
            m["ratio_above_floor"] = (m["half_rss"] - floor) / (m["full_rss"] - floor)


def _clean_up(args, procs: Procs, tmp: Path, report: dict) -> None:
    """Stops every process of the run, even on a second Ctrl-C, and removes its logs and traces once
    the run finished, unless ``--keep-logs``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    procs.stop()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not args.keep_logs and "summary" in report:
        shutil.rmtree(tmp, ignore_errors=True)
        report["logs"] = None


def run(args, state: dict) -> dict:
    import torch

    from fabric.compute.models import (
        default_cache_root,
        load_config,
        load_tokenizer,
        resolve,
    )
    from fabric.node.route_session import eos_ids
    from fabric.wire.shard import Shard, even_split

    cores = os.cpu_count() or 1
    source = resolve(args.model)
    args.model_id = source.model_id  # what clients ask for (a directory's name)
    config = load_config(source, default_cache_root())
    num_layers, hidden = config.num_hidden_layers, config.hidden_size
    tokenizer = load_tokenizer(source, default_cache_root())
    eos = sorted(eos_ids(tokenizer, config))
    tmp = Path(tempfile.mkdtemp(prefix="meshnet-bench-"))
    procs = Procs(tmp)
    half = Shard(0, num_layers // 2 - 1, num_layers)
    report = _report_header(args, state, cores, num_layers, hidden, tmp)
    log(f"logs and traces in {tmp}")
    results: dict[str, list] = state.setdefault("results", {})
    gate = Gate(args.tries, args.max_wait, args.budget * 60)
    try:
        raw = RawRTT(procs, hidden * getattr(torch, args.dtype).itemsize)
        extra = device_args(args)
        # phase A: what users run, threads per node as `meshnet up` assigns them
        main = [Cluster(f"fabric-{n}", f"fabric {n} node{'s' * (n > 1)}", even_split(num_layers, n),
                        "auto") for n in (1, 2, 3)]  # no --threads, as `meshnet up`
        for c in main:
            start_cluster(procs, c, args.model, tmp, extra)
        log("loading the single-process baseline while the nodes load")
        base = Baseline(source, tokenizer, eos, args.dtype, args.device)
        reference = _phase_a(args, procs, main, base, cores, results, raw, gate)
        diag = _phase_b(args, procs, tmp, extra, base, num_layers, cores, results, raw, gate)
        _finish_report(args, report, cores, main, diag, results, reference, raw, half)
    finally:
        _clean_up(args, procs, tmp, report)
    report["results"] = {k: [{kk: vv for kk, vv in r.items() if kk != "ids"} for r in v]
                         for k, v in results.items()}
    return report


def warm_up(c: Cluster, args, results: dict, tries: int = 3) -> None:
    """One untimed generation (also the 'after one generation' memory point); a cluster the
    fabric keeps failing is reported and left out of the timed runs."""
    for _ in range(tries):
        r = fabric_generate(c, args.model_id, args.tokens)
        results.setdefault(f"{c.key}-warmup", []).append(r)
        if r["error"] is None:
            c.rss_gen = [memory(p) for _, p, _ in c.nodes]
            return
    c.failed = True
    log(f"{c.label}: every warm-up generation failed; left out of the timed runs")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _stats(results: dict, key: str) -> dict:
    """Decode tok/s of configuration ``key``: median over its quiet runs (all runs when too few were
    quiet), over all runs, how many of each, its failures, runs cut short and the others' median load."""
    every = results.get(key, [])
    runs = [r for r in every if not r.get("error") and not r.get("aborted")]
    quiet = [r for r in runs if r["quiet"]]
    use = quiet if len(quiet) >= MIN_QUIET else runs
    return {"tps": median([r["decode_tps"] for r in use]), "tps_all": median([r["decode_tps"] for r in runs]),
            "n_quiet": len(quiet), "n_all": len(runs), "noisy": len(quiet) < MIN_QUIET,
            "failed": [r["error"] for r in every + results.get(f"{key}-warmup", []) if r.get("error")],
            "cut_short": sum(1 for r in every if r.get("aborted")),
            "foreign_load": median([r["foreign_load"] for r in use])}


def _ids_check(results: dict, key: str, ref_ids: list[int]) -> dict:
    """Whether every completed run of ``key`` (warm-ups included) gave the reference token ids, the
    first token that differs where one did not, and how many runs were checked."""
    runs = [r for r in results.get(key, []) + results.get(f"{key}-warmup", [])
            if not r.get("error") and not r.get("aborted")]
    for r in runs:
        if r["ids"] != ref_ids:
            first = next((i for i, (a, b) in enumerate(zip(r["ids"], ref_ids)) if a != b),
                         min(len(r["ids"]), len(ref_ids)))
            return {"ids_match": False, "first_mismatch": first, "ids_checked": len(runs)}
    return {"ids_match": True, "first_mismatch": None, "ids_checked": len(runs)}


def _row(results: dict, ref_ids: list[int], key, label, layout, threads, vs) -> dict:
    """One configuration's row of the report, compared with row ``vs`` (ratios are added later)."""
    return {"key": key, "label": label, "layout": layout, "threads": threads, "vs": vs, **_stats(results, key),
            **_ids_check(results, key, ref_ids)}


def _throughput_rows(args, cores, main, diag, results, ref_ids) -> tuple[list, list, dict]:
    """The rows of the timed configurations and of the diagnostic ones, each with its processes lost
    and its ratios against its ``vs`` row, and every row by key."""
    base_key = f"baseline-{cores}t"
    full_layout = f"0-{args.layers_total - 1}"
    rows = [_row(results, ref_ids, base_key, "transformers generate, 1 process", full_layout, cores, base_key)]
    rows += [_row(results, ref_ids, c.key, c.label, c.layout(), c.threads, base_key) for c in main]
    diag_rows = [_row(results, ref_ids, "baseline-1t", "transformers generate, 1 process", full_layout, 1,
                      "baseline-1t")]
    if results.get(f"{base_key}-diag"):
        diag_rows.append(_row(results, ref_ids, f"{base_key}-diag", "transformers generate, 1 process", full_layout,
                              cores, f"{base_key}-diag"))
    diag_rows += [_row(results, ref_ids, c.key, c.label, c.layout(), c.threads,
                       "baseline-1t" if c.threads == 1 else f"{base_key}-diag") for c in diag]
    everything = {r["key"]: r for r in rows + diag_rows}
    for c in main + diag:
        everything[c.key]["lost"] = [f"{' '.join(map(str, a))} exited with {code}" for a, code in c.lost]
    for r in rows + diag_rows:
        vs = everything[r["vs"]]
        r["ratio"] = r["tps"] / vs["tps"] if r["tps"] and vs["tps"] else None
        r["ratio_all"] = r["tps_all"] / vs["tps_all"] if r["tps_all"] and vs["tps_all"] else None
        r["ratio_noisy"] = r["noisy"] or vs["noisy"]
    return rows, diag_rows, everything


def _memory_figures(clusters: list[Cluster], full_layout: str, half) -> tuple[dict, dict]:
    """RSS and USS of the full and the half node after load and after a generation (medians, and the
    half / full RSS ratio), and every node's figures by its layers."""
    by_layers: dict[str, list] = {}
    for c in clusters:
        for (shard, _, _), load_m, gen_m in zip(c.nodes, c.rss_load, c.rss_gen):
            by_layers.setdefault(str(shard), []).append({"cluster": c.key, "threads": c.threads,
                                                        "rss_load": load_m[0], "uss_load": load_m[1],
                                                        "rss_gen": gen_m[0], "uss_gen": gen_m[1]})
    full, halfm = by_layers.get(full_layout, []), by_layers.get(str(half), [])
    mem: dict = {}
    for when in ("load", "gen"):
        f = median([m[f"rss_{when}"] for m in full])
        h = median([m[f"rss_{when}"] for m in halfm])
        mem[when] = {"full_rss": f, "half_rss": h, "ratio": h / f if f and h else None,
                     "full_uss": median([m[f"uss_{when}"] for m in full]),
                     "half_uss": median([m[f"uss_{when}"] for m in halfm])}
    return mem, by_layers


def _summary(everything: dict, trace: dict, rawsum: dict, mem: dict) -> dict:
    """The headline figures (2-node ratio, added latency per hop, memory ratios) and whether each meets
    its target."""
    t1, t2 = trace.get("diag-1n-1t") or {}, trace.get("diag-2n-1t") or {}
    hop_us = (t2["overhead_us"] - t1["overhead_us"]) if t1 and t2 else None
    d1, d2 = everything["diag-1n-1t"]["tps"], everything["diag-2n-1t"]["tps"]
    indirect_us = (1e6 / d2 - 1e6 / d1) if d1 and d2 else None
    two = everything["fabric-2"]
    summary = {
        "two_node_ratio": two["ratio"], "two_node_ratio_all_runs": two["ratio_all"],
        "two_node_noisy": two["ratio_noisy"],
        "hop_added_us": hop_us, "hop_indirect_us": indirect_us, "raw_rtt_us": rawsum["median_us"],
        "hop_ratio": hop_us / rawsum["median_us"] if hop_us is not None and rawsum["median_us"] else None,
        "hop_noisy": (everything["diag-1n-1t"]["noisy"] or everything["diag-2n-1t"]["noisy"]
                      or not rawsum["quiet_blocks"]),
        "memory_ratio_gen": mem["gen"]["ratio"], "memory_ratio_load": mem["load"]["ratio"],
    }
    summary["pass"] = {
        "two_node": two["ratio"] is not None and two["ratio"] >= TARGETS["two_node_ratio"],
        "hop": summary["hop_ratio"] is not None and summary["hop_ratio"] <= TARGETS["hop_ratio"],
        "memory": all(m["ratio"] is not None and m["ratio"] <= TARGETS["memory_ratio"] for m in mem.values()),
    }
    return summary


def analyse(args, cores, main, diag, results, reference, raw, half) -> dict:
    ref_ids = reference["ids"]
    rows, diag_rows, everything = _throughput_rows(args, cores, main, diag, results, ref_ids)
    rawsum = raw.summary()
    trace = {c.key: hop_breakdown(c) for c in diag}
    mem, by_layers = _memory_figures(main + diag, f"0-{args.layers_total - 1}", half)
    summary = _summary(everything, trace, rawsum, mem)
    return {"throughput": rows, "diagnostics": diag_rows, "hop_trace": trace, "raw_rtt": rawsum,
            "memory": mem, "memory_by_layers": by_layers, "summary": summary,
            "reference_tokens": len(ref_ids), "reference_ids": ref_ids}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))] if xs else None


# --------------------------------------------------------------------------- output


def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None else fmt.format(x)


def _mib(x):
    return "n/a" if not x else f"{x / 2**20:.0f}"


def _us(x):
    """``x`` µs as a whole number, or n/a."""
    return _f(x, "{:.0f}")


def _table(rows) -> None:
    """Prints one throughput table: a line per configuration, then its failures and lost processes."""
    print(f"  {'configuration':<34} {'layers':<19} {'thr':>3} {'tok/s':>6} {'ratio':>5} {'quiet':>5}"
          f" {'others':>6} | {'all runs':>8} {'ratio':>5}  greedy ids vs transformers")
    for row in rows:
        ids = ("no successful run" if not row["ids_checked"] else "identical" if row["ids_match"]
               else f"DIFFER from token {row['first_mismatch']}")
        flag = "*" if row["noisy"] else " "
        print(f"  {row['label']:<34} {row['layout']:<19} {row['threads']:>3} {_f(row['tps']):>6}{flag}"
              f"{_f(row['ratio']):>5} {row['n_quiet']:>2}/{row['n_all']:<2} {_f(row['foreign_load'], '{:.0%}'):>6}"
              f" | {_f(row['tps_all']):>8} {_f(row['ratio_all']):>5}  {ids} ({row['ids_checked']} runs)"
              + (f"; {row['cut_short']} cut short" if row["cut_short"] else "")
              + (f"; {len(row['failed'])} run(s) FAILED" if row["failed"] else ""))
    for row in rows:
        for err in row["failed"]:
            print(f"      {row['key']} failed: {err}")
        for lost in row.get("lost", []):
            print(f"      {row['key']}: a process died during the run (killed from outside?): {lost}")


def _print_header(r: dict) -> None:
    """Prints what was measured, on what machine, with which threads."""
    m = r["machine"]
    cores = m["cores"]
    print(f"\nmeshnet fabric bench: {r['model']} ({r['layers']} layers, hidden {r['hidden']}), "
          f"{r['tokens']} new tokens, {r['reps']} reps per configuration, medians; "
          f"{r.get('dtype', 'float32')} on {r.get('device', 'cpu')}")
    print(f"machine: {cores} cores ({m['cpu']}), {m['mem_total_gib']} GiB, torch {m['torch']}, "
          f"transformers {m['transformers']}, python {m['python']}")
    print(f"threads: baseline {cores}; each fabric node gets (as `meshnet up`): "
          + ", ".join(f"{row['layout'].count('|') + 1} node(s) -> {row['threads']}" for row in r["throughput"][1:]))


def _print_throughput(r: dict) -> None:
    """Prints section 1: decode tok/s of every configuration, then of the diagnostic ones."""
    print(f"\n1. decode tok/s, first token event -> done (transformers: first streamed token -> end); ratio vs the\n"
          f"   single process with the same threads. Medians over the quiet runs (other tenants used <= "
          f"{r['quiet_threshold']:.0%} of the CPU;\n   'quiet' = quiet/completed runs, 'others' = their median "
          f"foreign load; runs that others\n"
          f"   disturbed were cut short and retried); "
          f"* = fewer than {MIN_QUIET} quiet runs, median of all runs")
    _table(r["throughput"])
    print("   diagnostics: traced nodes (same CLI + timing hooks), equal thread counts:")
    _table(r["diagnostics"])


def _print_hop_steps(t1: dict, t2: dict) -> None:
    """Prints the traced decode steps of 1 and 2 nodes, split into their parts (medians, µs)."""
    print(f"   traced decode steps (medians, µs; {t1['steps']} steps on 1 node, {t2['steps']} on 2 nodes):")
    print(f"     1 node : compute {_us(t1['compute_us'][0])}; non-compute per token {_us(t1['overhead_us'])}"
          f" = sample {_us(t1.get('ret_sample_us'))} + token to self {_us(t1.get('ret_send_local_us'))}"
          f" + on_token {_us(t1.get('ret_on_token_us'))} + emit/loop {_us(t1.get('ret_emit_loop_us'))}")
    print(f"     2 nodes: compute {' + '.join(_us(x) for x in t2['compute_us'])}; non-compute per token "
          f"{_us(t2['overhead_us'])}")
    print(f"       forward leg {_us(t2['forward_legs_us'][0])} = encode+send {_us(t2.get('fwd_encode_send_us'))}"
          f" + wire/wake {_us(t2.get('fwd_wire_wake_us'))} + decode {_us(t2.get('fwd_decode_us'))}"
          f" + queue {_us(t2.get('fwd_queue_us'))}")
    print(f"       return leg {_us(t2.get('return_leg_us'))} = sample {_us(t2.get('ret_sample_us'))}"
          f" + encode/send/wire/wake {_us(t2.get('ret_send_wire_wake_us'))} + decode {_us(t2.get('ret_decode_us'))}"
          f" + dispatch {_us(t2.get('ret_dispatch_us'))} + on_token {_us(t2.get('ret_on_token_us'))}"
          f" + emit/loop {_us(t2.get('ret_emit_loop_us'))}")


def _print_hop(r: dict) -> None:
    """Prints section 2: the raw round trip, the traced decode steps and the latency each hop adds."""
    raw, s = r["raw_rtt"], r["summary"]
    print(f"\n2. per hop. raw pyzmq DEALER->ROUTER echo round trip of {raw.get('bytes', r['hidden'] * 4)} B: median "
          f"{_f(raw['median_us'], '{:.0f}')} µs (p10 {_f(raw['p10_us'], '{:.0f}')}, p90 {_f(raw['p90_us'], '{:.0f}')}, "
          f"{raw['n']} round trips, {raw['quiet_blocks']}/{raw['blocks']} quiet blocks)")
    t1, t2 = r["hop_trace"].get("diag-1n-1t") or {}, r["hop_trace"].get("diag-2n-1t") or {}
    if t1 and t2:
        _print_hop_steps(t1, t2)
    print(f"   added per hop = 2-node non-compute − 1-node non-compute = {_us(s['hop_added_us'])} µs = "
          f"{_f(s['hop_ratio'])}× raw")
    print(f"   cross-check, per-token time 2 nodes − 1 node (1 thread each, compute noise included): "
          f"{_us(s['hop_indirect_us'])} µs")
    paced = raw.get("paced")
    if paced:
        print(f"   raw round trip paced like a decode step (both ends idle {paced['gap_ms']:.0f} ms first, as each "
              f"node idles while the other computes): median {_us(paced['median_us'])} µs (p90 "
              f"{_us(paced['p90_us'])}, {paced['n']} round trips); added per hop = "
              f"{_f(s.get('hop_ratio_paced'))}× that")


def _print_memory(r: dict) -> None:
    """Prints section 3: every node's resident memory, the half / full ratio and the runtime floor."""
    print("\n3. resident memory, MiB: RSS after load / after one generation (USS in brackets)")
    for layers, ms in sorted(r["memory_by_layers"].items(), key=lambda kv: int(kv[0].split("-")[0])):
        for mm in ms:
            print(f"   layers {layers:<6} {mm['cluster']:<11} {mm['threads']}t  {_mib(mm['rss_load']):>5} / "
                  f"{_mib(mm['rss_gen']):>5}  ({_mib(mm['uss_load'])} / {_mib(mm['uss_gen'])})")
    mem = r["memory"]
    print(f"   half (0-{r['layers'] // 2 - 1}) / full (0-{r['layers'] - 1}) RSS: after load "
          f"{_f(mem['load']['ratio'])}, after a generation {_f(mem['gen']['ratio'])}")
    if mem.get("runtime_floor_rss"):
        print(f"   runtime floor (python + torch + transformers + fabric imported, no weights): "
              f"{_mib(mem['runtime_floor_rss'])} MiB; above it half / full = "
              f"{_f(mem['load'].get('ratio_above_floor'))} after load, "
              f"{_f(mem['gen'].get('ratio_above_floor'))} after a generation")


def _verdict(ok, noisy=False):
    """PASS or MISS, with a '?' when the figure comes from noisy runs."""
    return ("PASS" if ok else "MISS") + ("?" if noisy else "")


def _print_targets(r: dict) -> None:
    """Prints each target of DESIGN.md with its figure and verdict."""
    s, mem = r["summary"], r["memory"]
    print("\ntargets (DESIGN.md; '?' = based on noisy runs, rerun when the machine is quieter):")
    print(f"  [{_verdict(s['pass']['two_node'], s['two_node_noisy'])}] 2-node decode >= "
          f"{TARGETS['two_node_ratio']}x single process: {_f(s['two_node_ratio'])}x "
          f"(all runs: {_f(s['two_node_ratio_all_runs'])}x)")
    print(f"  [{_verdict(s['pass']['hop'], s['hop_noisy'])}] added latency per hop <= {TARGETS['hop_ratio']}x raw "
          f"round trip: {_f(s['hop_ratio'])}x ({_us(s['hop_added_us'])} µs vs {_us(s['raw_rtt_us'])} µs)"
          + (f"; {_f(s['hop_ratio_paced'])}x a raw trip paced like a decode step" if s.get("hop_ratio_paced") else ""))
    print(f"  [{_verdict(s['pass']['memory'])}] half-model node RSS <= {TARGETS['memory_ratio']}x full node: "
          f"{_f(mem['load']['ratio'])}x after load, {_f(mem['gen']['ratio'])}x after a generation")


def print_report(r: dict) -> None:
    _print_header(r)
    _print_throughput(r)
    _print_hop(r)
    _print_memory(r)
    _print_targets(r)


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps, no 2-thread diagnostic cluster")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (default 64, quick 24)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per configuration (default 5, quick 2)")
    ap.add_argument("--json", metavar="OUT", default=None, help="also write every figure and sample as JSON")
    ap.add_argument("--model", default="smollm2-135m", help="model reference (default %(default)s)")
    ap.add_argument("--keep-logs", action="store_true", help="keep node logs and traces")
    add_device_args(ap)
    ap.add_argument("--tries", type=int, default=None,
                    help="attempts per timed run when other tenants disturb it (default 3, quick 2)")
    ap.add_argument("--max-wait", type=float, default=30.0,
                    help="seconds to wait for a quiet machine before each timed run (default %(default)s)")
    ap.add_argument("--budget", type=float, default=None,
                    help="minutes after which runs are no longer gated or retried (default 40, quick 8)")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (24 if args.quick else 64)
    args.reps = args.reps or (2 if args.quick else 5)
    args.tries = max(1, args.tries or (2 if args.quick else 3))
    args.budget = args.budget if args.budget is not None else (8.0 if args.quick else 40.0)
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (decode rate needs two tokens)")

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the shell started us with SIGINT ignored
    signal.signal(signal.SIGTERM, on_term)
    from fabric.compute.models import default_cache_root, load_config, resolve

    args.layers_total = load_config(resolve(args.model), default_cache_root()).num_hidden_layers
    state: dict = {}
    try:
        report = run(args, state)
    except KeyboardInterrupt:
        log("interrupted; every subprocess was stopped")
        if args.json and state.get("results"):
            partial = {**state.get("report", {}), "interrupted": True,
                       "results": {k: [{kk: vv for kk, vv in r.items() if kk != "ids"} for r in v]
                                   for k, v in state["results"].items()}}
            Path(args.json).write_text(json.dumps(partial, indent=2, default=str))
            log(f"wrote the partial results to {args.json}")
        return 130
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
