"""A userspace TCP delay proxy: forwards connections and delays every chunk, both ways.

The test bed (``tests/netbed.py``) runs one in a host's network namespace in front of each
service it exposes, where the kernel has no ``netem`` qdisc. Services bind loopback; the
proxy listens on the host's address, so every peer frame crosses it::

    python3 -m tests.delay_proxy --map 10.77.0.2:7000=127.0.0.1:7000 [--map ...]
        [--delay 0.002] [--jitter 0.0005] [--links links.json --self 10.77.0.2]
        [--ready-file PATH]

How long a chunk is held, in each direction, is the sum of
- ``--delay`` ± ``--jitter`` (uniform), for every connection;
- with ``--links``: the one-way delay ± jitter of the dialling host's link plus that of
  this host's link (``--self``), read from a JSON map ``{"10.77.0.3": [delay, jitter]}``
  keyed by address. This models hosts on one switch, each behind its own link, as
  ``netem`` on both ends of each host's veth would. Connections from this host itself
  (``--self`` or loopback) get no link delay, as loopback traffic would not.

Order is kept: a chunk never leaves before the one read before it, so jitter never
reorders a stream. End of stream is forwarded after the same delay; a reset or a failed
connection to the target closes both sides. SIGHUP re-reads ``--links``: open connections
use the new delays from their next chunk on. Nagle is off on both sides.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("delay_proxy")

CHUNK = 1 << 16  # bytes read at a time
QUEUED = 64  # chunks held per direction before reading pauses (back-pressure)


@dataclass
class Delays:
    """Where a chunk's delay comes from: a fixed part and, optionally, the two hosts' links."""

    delay: float = 0.0  # seconds added to every chunk, each direction
    jitter: float = 0.0  # +- this much, uniform
    me: str | None = None  # this host's address in ``links``
    links: dict[str, tuple[float, float]] = field(default_factory=dict)  # address -> (delay, jitter)
    links_file: Path | None = None

    def load(self) -> None:
        if self.links_file is not None:
            table = json.loads(self.links_file.read_text())
            self.links = {ip: (float(d), float(j)) for ip, (d, j) in table.items()}

    def sample(self, peer: str) -> float:
        """Seconds to hold one chunk of a connection from ``peer``."""
        total = _draw(self.delay, self.jitter)
        if self.me and peer != self.me and not peer.startswith("127."):
            for ip in (peer, self.me):
                total += _draw(*self.links.get(ip, (0.0, 0.0)))
        return total


def _draw(delay: float, jitter: float) -> float:
    return max(0.0, delay + random.uniform(-jitter, jitter)) if jitter else delay


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hold) -> None:
    """Copy ``reader`` to ``writer``, each chunk held ``hold()`` seconds, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(QUEUED)

    async def read() -> None:
        try:
            while chunk := await reader.read(CHUNK):
                await queue.put((loop.time() + hold(), chunk))
        except OSError:
            await queue.put((loop.time(), None))  # reset: no point delaying it
            return
        await queue.put((loop.time() + hold(), b""))  # end of stream, delayed like data

    async def write() -> None:
        last = 0.0
        while True:
            due, chunk = await queue.get()
            last = max(due, last)  # never overtake the chunk before
            if (wait := last - loop.time()) > 0:
                await asyncio.sleep(wait)
            if chunk is None:
                raise ConnectionResetError("the other side reset the connection")
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
        await reading
    finally:
        reading.cancel()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _serve_one(delays: Delays, target: tuple[str, int], c_reader, c_writer) -> None:
    peer = c_writer.get_extra_info("peername")[0]
    hold = lambda: delays.sample(peer)  # noqa: E731 - read per chunk, so SIGHUP applies at once
    try:
        t_reader, t_writer = await asyncio.open_connection(*target)
    except OSError as exc:
        log.debug("%s -> %s:%d refused: %s", peer, *target, exc)
        await asyncio.sleep(hold())  # the refusal travels back like any packet
        c_writer.transport.abort()
        return
    _nodelay(c_writer)
    _nodelay(t_writer)
    pipes = [asyncio.ensure_future(_pipe(c_reader, t_writer, hold)),
             asyncio.ensure_future(_pipe(t_reader, c_writer, hold))]
    try:
        pending = pipes
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.exception() for t in done):  # a reset or broken pipe: drop both sides
                break
    finally:
        for t in pipes:
            t.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        for w in (c_writer, t_writer):
            w.transport.abort()


async def serve(maps: list[tuple[tuple[str, int], tuple[str, int]]], delays: Delays,
                ready_file: Path | None = None, stop: asyncio.Event | None = None) -> None:
    """Listen on every ``(listen, target)`` pair until ``stop`` is set (or forever)."""
    servers = []
    for listen, target in maps:
        servers.append(await asyncio.start_server(
            lambda r, w, target=target: _serve_one(delays, target, r, w), *listen, reuse_address=True))
        log.info("%s:%d -> %s:%d", *listen, *target)
    if ready_file is not None:
        ready_file.write_text("ready\n")
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        for s in servers:
            s.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="delay_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--map", action="append", required=True, metavar="LISTEN=TARGET",
                        help="listen on HOST:PORT and forward to HOST:PORT (repeatable)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds added to every chunk, each way")
    parser.add_argument("--jitter", type=float, default=0.0, help="+- seconds, uniform")
    parser.add_argument("--links", type=Path, default=None, help="JSON {address: [delay, jitter]} of host links")
    parser.add_argument("--self", dest="me", default=None, help="this host's address in --links")
    parser.add_argument("--ready-file", type=Path, default=None, help="written once every listener is bound")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    maps = [(_address(a), _address(b)) for a, b in (m.split("=", 1) for m in args.map)]
    delays = Delays(args.delay, args.jitter, args.me, links_file=args.links)
    delays.load()

    async def run() -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        loop.add_signal_handler(signal.SIGHUP, delays.load)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(maps, delays, args.ready_file, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
