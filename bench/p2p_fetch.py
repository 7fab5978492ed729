#!/usr/bin/env python
"""Weights from peers on loopback: the fetch rate against a plain copy of the same bytes, and
the inter-token latency of a stream on the serving node while it serves a fetch.

    python bench/p2p_fetch.py [--model smollm2-135m] [--layers 15-29] [--share-mbps 0]
                              [--rounds 5] [--other DIR] [--slow-peer MBPS] [--itl-tokens 120]
                              [--itl-share-mbps 400] [--itl-rounds 1] [--itl-speculation]

Starts a tracker and one node holding the whole file (``python -m fabric.cli ...``), then:

1. fetch rate: ``fetch_layers`` as a node without the file runs it (``meshnet node --model ID
   --layers A-B --tracker T``) into an empty directory, timed from the call (the tracker's
   answer included) to the renamed file the node serves from (its bytes reach the disk after,
   as a ``cp``'s do), against ``cp`` of the whole file (both read a file the page cache holds),
   alternated; the median of ``--rounds`` (five) of each, printed as bytes/s and their ratio
   (target >= 0.5x). Then the same fetch until its bytes are on disk too (``fdatasync``: what
   ``meshnet pull MODEL --layers A-B --tracker T`` waits for). Beside them, what bounds
   the fetch on this machine: the CPU seconds the fetching process and the serving node
   spent per fetch, the same bytes through a bare ZeroMQ DEALER/ROUTER pair between two
   processes (4 MiB messages, 16 in flight, nothing hashed or written: the transport's
   ceiling), and the manifest's hash (BLAKE3) over the bytes in one thread, as a fetch's store
   thread takes it. ``--slow-peer MBPS``: a second node holds the file too, behind that cap, and
   every fetch of the rate run asks both (a LAN with one machine on a slow link);
2. ITL: one greedy stream of ``--itl-tokens`` tokens on that node alone, then the same stream
   while fetches of every layer run back to back against it from another process (its cap
   ``--itl-share-mbps``):
   the p99 and median gap between tokens of each (target: p99 within 1.5x the median);
   ``--itl-rounds N`` alternates the two N times and pools each one's gaps, and also prints
   each stream's own p99 over its own median (pooled, streams whose medians the machine's
   drift moved apart widen the spread by themselves). The streams do not draft
   (``speculation=False``) unless ``--itl-speculation``: a drafting stream's tokens come in
   bursts (the drafts a verification kept arrive together, and a step whose drafts fail
   costs up to twice a one-token step), so its gaps' p99 measures the drafts, not the fetch.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fabric import Client  # noqa: E402
from fabric.cli.supervision import stop_processes  # noqa: E402
from fabric.compute.gguf_info import read_header  # noqa: E402
from fabric.compute.gguf_manifest import item_hasher  # noqa: E402
from fabric.compute.models import resolve  # noqa: E402
from fabric.fetch.pull import fetch_layers  # noqa: E402
from tests.support import free_port, wait_for  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def spawn(tmp: Path, name: str, *args: str) -> subprocess.Popen:
    env_cache = {"XDG_CACHE_HOME": str(tmp / "cache"), "XDG_DATA_HOME": str(tmp / "data"),
                 "PYTHONPATH": str(REPO)}
    log = open(tmp / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "fabric.cli", "--log-level", "info", *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env_cache}, cwd=REPO)


def start(tmp: Path, model: str, layers: int, *caps: float) -> tuple[list[subprocess.Popen], str]:
    """A tracker and a node holding the whole file for each cap in ``caps`` (``--share-mbps``)."""
    tracker = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn(tmp, "tracker", "tracker", "--bind", tracker, "--pub", f"tcp://127.0.0.1:{free_port()}",
                   "--db", str(tmp / "ledger.sqlite3"))]
    for i, share_mbps in enumerate(caps):
        procs.append(spawn(tmp, f"node{i}-{share_mbps:g}", "node", "--model", model, "--tracker", tracker,
                           "--layers", f"0-{layers - 1}", "--bind", f"tcp://127.0.0.1:{free_port()}",
                           "--no-progress", "--share-mbps", str(share_mbps), "--compute-lock", "none"))
    return procs, tracker


def wait_ready(tracker: str, model_id: str, nodes: int = 1) -> None:
    def ready() -> bool:
        try:
            with Client(tracker, timeout=2) as c:
                status = c.status()
            return bool(status["plans"].get(model_id)) and len(status["nodes"]) >= nodes
        except Exception:  # noqa: BLE001 -- still starting
            return False
    if not wait_for(ready, 300, 0.5):
        raise SystemExit("the node did not come up; see its log")


def fetch_rate(tracker: str, model_id: str, layers: str | None, tmp: Path, durable: bool = False) -> tuple[int, float]:
    """(bytes, seconds) of one fetch into an empty directory: until a node could serve from it
    (``durable``: until its bytes are on disk, as ``meshnet pull`` waits)."""
    target = Path(tempfile.mkdtemp(dir=tmp))
    began = time.perf_counter()
    path = fetch_layers(model_id, layers, tracker, None, target, progress=False, say=lambda _: None, durable=durable)
    took = time.perf_counter() - began
    size = path.stat().st_size
    shutil.rmtree(target)
    os.sync()  # the next measurement starts with nothing left to write back (the node's fetch syncs after)
    return size, took


FETCH_ONCE = """
import inspect, os, shutil, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fabric.fetch.pull import fetch_layers
node_path = {"durable": False} if "durable" in inspect.signature(fetch_layers).parameters else {}  # an older checkout syncs
tracker, model, layers, tmp, node = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
def node_cpu():
    return time.clock_gettime((~int(node) << 3) | 2)  # the process's CPU clock (Linux's encoding), every thread
warm = Path(tempfile.mkdtemp(dir=tmp))
fetch_layers(model, layers, tracker, None, warm, progress=False, say=lambda _: None)
shutil.rmtree(warm)
os.sync()
target, t, n = Path(tempfile.mkdtemp(dir=tmp)), time.process_time(), node_cpu()
began = time.perf_counter()
path = fetch_layers(model, layers, tracker, None, target, progress=False, say=lambda _: None, **node_path)
took, t2 = time.perf_counter() - began, time.process_time()
print(took, t2 - t, node_cpu() - n, path.stat().st_size)
shutil.rmtree(target)
os.sync()  # the next measurement starts with nothing left to write back
"""


def fetch_in(checkout: Path, tracker: str, model_id: str, layers: str, tmp: Path, node: int) -> tuple[float, ...]:
    """(seconds, fetcher CPU-s, node CPU-s, bytes) of one fetch by ``checkout``'s code, in a process
    of its own (after one fetch there that warms its imports)."""
    out = subprocess.run([sys.executable, "-c", FETCH_ONCE, str(checkout), tracker, model_id, layers, str(tmp),
                          str(node)], capture_output=True, text=True, check=True, cwd=checkout,
                         env={**os.environ, "PYTHONPATH": str(checkout)}).stdout
    return tuple(float(x) for x in out.split()[-4:])


def compare(args, tracker: str, tmp: Path) -> None:
    """``--other DIR``: fetches by this checkout's code and by DIR's, alternated, each followed by a cp."""
    mine, other, copies = [], [], []
    for _ in range(args.rounds):
        mine.append(fetch_in(REPO, tracker, args.model_id, args.layers, tmp, node_pid[0]))
        other.append(fetch_in(Path(args.other), tracker, args.model_id, args.layers, tmp, node_pid[0]))
        copies.append(copy_rate(args.path, tmp)[1])
    cp = statistics.median(copies)
    size = args.path.stat().st_size
    print(f"cp of the whole file: {size:,} bytes, median {cp:.3f} s = {size / cp / 1e6:.1f} MB/s")
    for name, runs in (("this checkout", mine), (str(args.other), other)):
        took, got = statistics.median(r[0] for r in runs), runs[0][3]
        print(f"{name}: fetch of layers {args.layers}, {got:,.0f} bytes, median {took:.3f} s = {got / took / 1e6:.1f} "
              f"MB/s, {(got / took) / (size / cp):.2f}x cp (runs {', '.join(f'{r[0]:.3f}' for r in runs)}); CPU per "
              f"fetch: fetcher {statistics.median(r[1] for r in runs):.3f} s, serving node "
              f"{statistics.median(r[2] for r in runs):.3f} s")


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds of process ``pid`` (None: this one), every thread, to the nanosecond: its CPU
    clock (``clock_getcpuclockid``'s, in Linux's encoding), not /proc's ticks of 10 ms, which a
    fetch of a tenth of a second spans only a few of."""
    return time.process_time() if pid is None else time.clock_gettime((~pid << 3) | 2)


def _serve_bytes(path: str, endpoint: str) -> None:
    """A bare ROUTER answering "offset length" with those bytes of ``path`` (zero copy from a mapping)."""
    import mmap

    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        while (frames := sock.recv_multipart())[1] != b"stop":
            offset, length = map(int, frames[1].split())
            sock.send_multipart([frames[0], view[offset:offset + length]], copy=False)
        view.release()
    sock.close(linger=0)


def zmq_ceiling(path: Path, nbytes: int, chunk: int = 4 << 20, window: int = 16, runs: int = 5) -> float:
    """Seconds (median) to move ``nbytes`` of ``path`` through a bare DEALER/ROUTER pair, nothing kept."""
    import zmq

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = multiprocessing.get_context("spawn").Process(target=_serve_bytes, args=(str(path), endpoint))
    server.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    times = []
    try:
        for _ in range(runs + 1):  # the first connects and warms up
            began, asked, got, inflight = time.perf_counter(), 0, 0, 0
            while got < nbytes:
                while inflight < window and asked < nbytes:
                    n = min(chunk, nbytes - asked)
                    sock.send(f"{asked} {n}".encode())
                    asked, inflight = asked + n, inflight + 1
                got += len(sock.recv(copy=False))
                inflight -= 1
            times.append(time.perf_counter() - began)
        sock.send(b"stop")
    finally:
        sock.close(linger=0)
        server.join(10)
    return statistics.median(times[1:])


def hash_seconds(path: Path, nbytes: int) -> float:
    data = path.read_bytes()[:nbytes]
    began = time.perf_counter()
    hasher = item_hasher()
    hasher.update(data)
    hasher.digest()
    return time.perf_counter() - began


def copy_rate(source: Path, tmp: Path) -> tuple[int, float]:
    target = tmp / "copy.gguf"
    subprocess.run(["cp", str(source), str(target)], check=True)  # warm: the node read it too
    target.unlink()
    began = time.perf_counter()
    subprocess.run(["cp", str(source), str(target)], check=True)
    took = time.perf_counter() - began
    target.unlink()
    os.sync()
    return source.stat().st_size, took


def gaps(tracker: str, model_id: str, tokens: int, speculation: bool = False) -> list[float]:
    """Seconds between the tokens of one greedy stream (drafting where ``speculation``)."""
    stamps = []
    with Client(tracker, timeout=120) as c:
        for event in c.generate(model_id, messages=MESSAGES, max_tokens=tokens, ignore_eos=True,
                                speculation=speculation):
            if event.token_ids:
                stamps += [time.perf_counter()] * len(event.token_ids)  # a verification's kept drafts: gaps of 0
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # the first gap holds the prefill's tail


FETCH_LOOP = """
import shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fabric.fetch.pull import fetch_layers
tracker, model, tmp, stop = sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])
fetched = 0
while not stop.exists():
    target = Path(tempfile.mkdtemp(dir=tmp))
    fetched += fetch_layers(model, None, tracker, None, target, progress=False, say=lambda _: None).stat().st_size
    shutil.rmtree(target)
print(fetched)
"""


def itl_under_fetch(tracker: str, model_id: str, tokens: int, tmp: Path,
                    speculation: bool = False) -> tuple[list[float], int]:
    """The stream's gaps while fetches of every layer run back to back, from a process of their
    own (as another machine's: the fetch's threads do not hold this one's GIL while it stamps
    tokens); the bytes fetched meanwhile."""
    stop, where = tmp / "stop", tmp / "fetches"
    stop.unlink(missing_ok=True)
    where.mkdir(exist_ok=True)
    loop = subprocess.Popen([sys.executable, "-c", FETCH_LOOP, str(REPO), tracker, model_id, str(where), str(stop)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: any(where.iterdir()), 60, 0.05)  # the fetch is under way before the stream starts
        measured = gaps(tracker, model_id, tokens, speculation)
    finally:
        stop.touch()
        out, _ = loop.communicate(timeout=120)
    return measured, int(out.split()[-1])


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else values[0]


node_pid = [0]  # the serving node's pid, for its CPU seconds


def run_node(args, tmp: Path, body, *caps: float) -> None:
    tmp.mkdir()
    procs, tracker = start(tmp, args.model, args.num_layers, *caps)
    node_pid[0] = procs[1].pid
    try:
        wait_ready(tracker, args.model_id, len(caps))
        body(tracker)
    finally:
        stop_processes(procs)


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="15-29", help="the range fetched for the rate (default %(default)s)")
    ap.add_argument("--share-mbps", type=float, default=0.0, help="the node's cap for the rate run (0: none)")
    ap.add_argument("--rounds", type=int, default=5, help="fetches (each followed by a cp) for the rate")
    ap.add_argument("--other", default=None, metavar="DIR",
                    help="another checkout (e.g. `git worktree add`): its fetches alternate with this one's, each in "
                         "a process of its own, with CPU seconds per fetch of both (the rate run only)")
    ap.add_argument("--slow-peer", type=float, default=None, metavar="MBPS",
                    help="a second node holding the file behind this cap: the rate run's fetches ask both")
    ap.add_argument("--itl-tokens", type=int, default=120)
    ap.add_argument("--itl-share-mbps", type=float, default=400.0, help="the node's cap for the ITL run")
    ap.add_argument("--itl-rounds", type=int, default=1,
                    help="streams alone and under fetch, alternated this many times (default %(default)s)")
    ap.add_argument("--itl-speculation", action="store_true",
                    help="the ITL streams draft (by default they do not: drafts make a stream's gaps bursty)")
    return ap.parse_args()


def rate(args, tracker: str, tmp: Path) -> None:
    """Prints the fetch rate of ``--layers`` against a cp of the whole file, with what bounds it here."""
    fetch_layers(args.model_id, args.layers, tracker, None, tmp / "warm", progress=False, say=lambda _: None)
    shutil.rmtree(tmp / "warm")  # a first fetch: the node's manifest and page cache are warm after it
    node = node_pid[0]
    runs, cpu, copies, synced = [], [], [], []
    for _ in range(args.rounds):  # a fetch, then a cp: alternated, so a busy machine's drift falls on both
        mine, its = cpu_seconds(), cpu_seconds(node)
        runs.append(fetch_rate(tracker, args.model_id, args.layers, tmp))
        cpu.append((cpu_seconds() - mine, cpu_seconds(node) - its))
        copies.append(copy_rate(args.path, tmp))
        synced.append(fetch_rate(tracker, args.model_id, args.layers, tmp, durable=True)[1])
    size, took = runs[0][0], statistics.median(t for _, t in runs)
    csize, ctook = copies[0][0], statistics.median(t for _, t in copies)
    bare, hashed = zmq_ceiling(args.path, size), hash_seconds(args.path, size)
    whole = args.path.stat().st_size
    print(f"fetch of layers {args.layers}: {size:,} bytes in {took:.3f} s = {size / took / 1e6:.1f} MB/s "
          f"(the file: {whole:,} bytes, {size / whole:.2f} of it; runs {', '.join(f'{t:.3f}' for _, t in runs)} s)")
    print(f"  until its bytes are on disk too (what meshnet pull waits for): {statistics.median(synced):.3f} s")
    print(f"  CPU per fetch: fetcher {statistics.median(c for c, _ in cpu):.3f} s, serving node "
          f"{statistics.median(c for _, c in cpu):.3f} s")
    print(f"cp of the whole file: {csize:,} bytes in {ctook:.3f} s = {csize / ctook / 1e6:.1f} MB/s")
    print(f"bare ZeroMQ pair, the same bytes: {bare:.3f} s = {size / bare / 1e6:.1f} MB/s; "
          f"BLAKE3 of them, one thread: {hashed:.3f} s = {size / hashed / 1e6:.1f} MB/s")
    print(f"fetch rate / cp rate: {(size / took) / (csize / ctook):.2f}x (target >= 0.5x); "
          f"fetch / bare ZeroMQ: {(size / took) / (size / bare):.2f}x")


def itl(args, tracker: str, tmp: Path) -> None:
    """Prints the gaps between a stream's tokens alone and while the node serves fetches, ``--itl-rounds`` of each."""
    alone, loaded, fetched = [], [], 0
    for _ in range(args.itl_rounds):  # alternated: a busy machine's drift falls on both alike
        alone.append(gaps(tracker, args.model_id, args.itl_tokens, args.itl_speculation))
        g, n = itl_under_fetch(tracker, args.model_id, args.itl_tokens, tmp / "itl", args.itl_speculation)
        loaded, fetched = loaded + [g], fetched + n
    print(f"{args.itl_rounds} round(s) of {args.itl_tokens} tokens, alone then serving fetches "
          f"({'drafting' if args.itl_speculation else 'no drafts'}):")
    for what, streams in (("alone", alone), (f"serving fetches ({fetched:,} bytes sent)", loaded)):
        g = [gap for stream in streams for gap in stream]
        each = [p99(stream) / statistics.median(stream) for stream in streams]
        print(f"ITL {what}: median {statistics.median(g) * 1000:.1f} ms, p99 {p99(g) * 1000:.1f} ms, "
              f"p99/median {p99(g) / statistics.median(g):.2f} (target <= 1.5); each stream's own: "
              f"{', '.join(f'{r:.2f}' for r in each)} (median {statistics.median(each):.2f})")


def main() -> None:
    args = parse_args()
    source = resolve(args.model)
    args.model_id, args.path = source.model_id, source.path
    args.num_layers = read_header(source.path).key("block_count")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        caps = (args.share_mbps,) if args.slow_peer is None else (args.share_mbps, args.slow_peer)
        body = (lambda t: compare(args, t, tmp / "rate")) if args.other else (lambda t: rate(args, t, tmp))
        run_node(args, tmp / "rate", body, *caps)
        if args.itl_tokens:
            run_node(args, tmp / "itl", lambda t: itl(args, t, tmp), args.itl_share_mbps)


if __name__ == "__main__":
    main()
