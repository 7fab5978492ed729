#!/usr/bin/env python
"""The client's own cost per event, in each shell: a scripted head on loopback streams
``--events`` token events as fast as it can, and ``Client`` and ``AsyncClient`` take them
with a route given (no tracker). Prints events/s per shell (the median of ``--reps`` runs)
and the asyncio shell's as a share of the blocking one's.

    python bench/client_shells.py [--events N] [--reps R]

Both shells drive the same programs (fabric/client/core.py, stream.py); what differs is how
they do the I/O. To compare two versions of the client, run it with each on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import zmq

from fabric import AsyncClient, Client
from fabric.wire import protocol as p


class ScriptedHead:
    """A ROUTER that answers each GENERATE with a start, ``events`` tokens and a done."""

    def __init__(self, events: int):
        self.events = events
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.route = (p.Hop("head", f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}", 0, 1),)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg, _ = p.decode(frames)
            if isinstance(msg, p.Generate):
                self._stream(identity, msg)

    def _stream(self, identity: bytes, msg: p.Generate) -> None:
        rid = msg.request_id
        self.sock.send_multipart([identity, *p.encode(p.Event(rid, "start", route=msg.route, seed=1))])
        for t in range(self.events):
            self.sock.send_multipart([identity, *p.encode(p.Event(rid, "token", text="x", token_ids=(t % 300,)))])
        done = p.Event(rid, "done", finish_reason="length", completion_tokens=self.events)
        self.sock.send_multipart([identity, *p.encode(done)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def blocking_rate(head: ScriptedHead) -> float:
    with Client("tcp://127.0.0.1:1", timeout=10) as client:
        start = time.perf_counter()
        count = sum(1 for _ in client.generate("m", prompt="x", max_tokens=head.events, route=head.route))
        return count / (time.perf_counter() - start)


async def asyncio_rate(head: ScriptedHead) -> float:
    async with AsyncClient("tcp://127.0.0.1:1", timeout=10) as client:
        start, count = time.perf_counter(), 0
        async for _ in client.generate("m", prompt="x", max_tokens=head.events, route=head.route):
            count += 1
        return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000, help="token events per request")
    parser.add_argument("--reps", type=int, default=5, help="runs per shell, alternating")
    args = parser.parse_args()
    head = ScriptedHead(args.events)
    rates: dict[str, list[float]] = {"Client": [], "AsyncClient": []}
    try:
        for _ in range(args.reps):
            rates["Client"].append(blocking_rate(head))
            rates["AsyncClient"].append(asyncio.run(asyncio_rate(head)))
    finally:
        head.close()
    medians = {shell: statistics.median(r) for shell, r in rates.items()}
    for shell, rate in medians.items():
        print(f"{shell:12s} {rate:9.0f} events/s (median of {args.reps})")
    print(f"AsyncClient / Client: {medians['AsyncClient'] / medians['Client']:.2f}")


if __name__ == "__main__":
    main()
