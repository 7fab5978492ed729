#!/usr/bin/env python
"""What waiting for the compute lock off the loop costs a hop, against the old blocking path, in one run.

    python bench/lock_wait.py [--hops 20000] [--rounds 5] [--handoffs 300] [--hold-ms 3]

1. Per hop, the lock free (one node alone on its machine, the common case). A loop shaped
   like the node's: a ROUTER polled beside the lock's wake-up fd, one small frame in, the
   lock taken and let go around an empty "hop", one frame out, to a DEALER in a thread of
   this process that times each round trip and sends the next frame when the answer comes.
   Variants, taking turns in small blocks: no lock at all; the old path (a blocking
   ``flock`` on the loop); the new one (``ComputeLock.request()``, which tries ``flock``
   without blocking, and ``release()``, the fd polled). Prints the median round trip of
   each and the lock's share (variant minus no lock), and the lock's calls alone in a
   tight loop (the steadiest figure on a busy machine).
2. Hand-off, the lock held by another process (a neighbour's pass). A child process takes
   the lock, holds it ``--hold-ms``, notes the time (CLOCK_MONOTONIC, shared by processes)
   and lets it go; this process waits meanwhile, the old way (blocked in ``flock``) or the
   new (the waiter thread blocks, its pipe wakes the poll), and notes when it holds the
   lock. Prints the median and 90th percentile of release -> held, in microseconds.

Ends with the CPU's flags that matter to this project's kernels (for BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from fabric.compute.compute_lock import ComputeLock  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")
BLOCKS = 20  # a round's hops per variant are split in this many blocks, the variants taking turns


class OldLock:
    """The compute lock as it was: ``flock`` blocking on the loop's thread."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def take(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


def _client(endpoint: str, hops: int, go: threading.Event, times: list[float]) -> None:
    """Send a frame, wait for its answer, ``hops`` times (a hidden state's size, 2304 B);
    each round trip's microseconds go to ``times``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    payload = bytes(2304)
    clock = time.perf_counter_ns
    go.wait()
    for _ in range(hops):
        t = clock()
        sock.send(payload)
        sock.recv()
        times.append((clock() - t) / 1e3)
    sock.close()


def loop_block(variant: str, path: str, hops: int) -> list[float]:
    """Round trips (us) of ``hops`` hops through a node-shaped loop with ``variant``'s lock."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    old, new = (OldLock(path), None) if variant == "old" else (None, ComputeLock(path) if variant == "new" else None)
    if new is not None:
        poller.register(new.fileno(), zmq.POLLIN)
    go, times = threading.Event(), []
    client = threading.Thread(target=_client, args=(endpoint, hops, go, times))
    client.start()
    go.set()
    for _ in range(hops):
        poller.poll(1000)
        identity, frame = router.recv_multipart()
        if old is not None:
            old.take()
            old.release()
        elif new is not None:
            if not new.request():
                raise RuntimeError("the lock is taken: nothing else may use it during the bench")
            new.release()
        router.send_multipart([identity, frame])
    client.join()
    router.close()
    for lock in (old, new):
        if lock is not None:
            lock.close()
    return times[len(times) // 10:]  # the first tenth warms the connection up


def calls_alone(path: str, n: int) -> dict[str, float]:
    """Microseconds per take + release, nothing else in the loop."""
    out = {}
    old, new = OldLock(path), ComputeLock(path)
    t = time.perf_counter()
    for _ in range(n):
        old.take()
        old.release()
    out["old"] = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        new.request()
        new.release()
    out["new"] = (time.perf_counter() - t) / n * 1e6
    old.close()
    new.close()
    return out


# -- hand-off from another process ---------------------------------------------------------

def hold(path: str, hold_ms: float) -> None:
    """The child: on each line read, take the lock, say so, hold it, note the time, let go."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    for _ in sys.stdin:
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(hold_ms / 1000)
        released = time.monotonic_ns()
        fcntl.flock(fd, fcntl.LOCK_UN)
        print(released, flush=True)


def _wait_old(lock: OldLock) -> bool:
    """Hold the lock the old way; False when it was free at once (no hand-off to time)."""
    try:
        fcntl.flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        lock.take()
        return True


def _wait_new(lock: ComputeLock, poller: zmq.Poller) -> bool:
    """Hold the lock the new way, polling as the node's loop does; False when free at once."""
    if lock.request():
        return False
    while not lock.request():
        poller.poll(50)
    return True


def handoffs(path: str, n: int, hold_ms: float) -> dict[str, list[float]]:
    """Release -> held in microseconds, per way, the ways taking turns."""
    child = subprocess.Popen([sys.executable, __file__, "--hold", path, "--hold-ms", str(hold_ms)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    old, new = OldLock(path), ComputeLock(path)
    router = zmq.Context.instance().socket(zmq.ROUTER)  # the loop polls its sockets too
    router.setsockopt(zmq.LINGER, 0)
    router.bind_to_random_port("tcp://127.0.0.1")
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(new.fileno(), zmq.POLLIN)
    out: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for i in range(2 * n):
            way = "old" if i % 2 == 0 else "new"
            child.stdin.write("go\n")
            assert child.stdout.readline().strip() == "held"
            waited = _wait_old(old) if way == "old" else _wait_new(new, poller)
            held = time.monotonic_ns()
            released = int(child.stdout.readline())
            (old if way == "old" else new).release()
            if waited:
                out[way].append((held - released) / 1e3)
    finally:
        child.stdin.close()
        child.wait(10)
        router.close()
        old.close()
        new.close()
    return out


def cpu_flags() -> str:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return f"{model}; " + " ".join(f"{f}={'yes' if f in words else 'no'}" for f in FLAGS)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hops", type=int, default=20000, help="hops per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=300, help="hand-offs per way")
    parser.add_argument("--hold-ms", type=float, default=3.0, help="how long the other process holds the lock")
    parser.add_argument("--hold", help=argparse.SUPPRESS)  # the child's mode: the lock file to hold
    args = parser.parse_args()
    if args.hold:
        hold(args.hold, args.hold_ms)
        return 0
    with tempfile.TemporaryDirectory(prefix="lock-wait-") as tmp:
        path = str(Path(tmp) / "compute.lock")
        per_hop: dict[str, list[float]] = {"none": [], "old": [], "new": []}  # us per round trip
        blocks: dict[str, list[float]] = {v: [] for v in per_hop}  # each block's median
        for b in range(args.rounds * BLOCKS):  # small blocks in rotating order: drift hits every variant alike
            for variant in list(per_hop)[b % 3:] + list(per_hop)[:b % 3]:
                times = loop_block(variant, path, args.hops // BLOCKS)
                per_hop[variant] += times
                blocks[variant].append(statistics.median(times))
        alone = [calls_alone(path, args.hops) for _ in range(args.rounds)]
        handed = handoffs(path, args.handoffs, args.hold_ms)
    med = {v: statistics.median(xs) for v, xs in per_hop.items()}
    print(f"per hop, lock free ({args.rounds} x {args.hops} round trips per variant, in blocks of "
          f"{args.hops // BLOCKS}; median us per round trip):")
    for v in per_hop:
        share = "" if v == "none" else f"   lock's share {med[v] - med['none']:+.2f} us"
        spread = statistics.quantiles(blocks[v], n=4)
        print(f"  {v:<5} {med[v]:8.2f}{share}   block medians: quartiles {spread[0]:.1f} / {spread[2]:.1f}")
    print(f"  new - old: {med['new'] - med['old']:+.2f} us per hop ({med['new'] / med['old']:.3f}x the old loop)")
    for way in ("old", "new"):
        print(f"  lock calls alone, {way}: {statistics.median(a[way] for a in alone):.2f} us per take + release")
    print(f"hand-off from another process holding it {args.hold_ms} ms (us from its release to held here):")
    for way, xs in handed.items():
        if xs:
            print(f"  {way:<5} median {statistics.median(xs):8.1f}   p90 {_pct(xs, 0.9):8.1f}   ({len(xs)} timed)")
    print(f"cpu: {cpu_flags()}; {os.cpu_count()} cores; python {sys.version.split()[0]}, pyzmq {zmq.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
