"""A rogue process: a stranger who reads the tracker's public feed, or a member who knows
more than it should, sending the frames an attacker would, over sockets of its own.

Run as ``python -m tests.adversary.rogue --tracker T --pub P``. It reads one JSON command a
line on stdin (``{"attack": NAME, ...}``), runs that attack against the request the feed
shows in flight, and answers one JSON line on stdout: what it sent and every frame it got
back (on the DEALERs it sent with, and on a ROUTER of its own that it names as ``reply_to``:
whatever a node would send to the head of a session the rogue opened, or hijacked, arrives
there). Whether an attack succeeded is for the caller to judge: it knows what the honest
clients saw (tests/adversary/arena.py).

Commands may carry what an insider knows: ``leaked`` (a live session id, as a hop of the
route knows it), ``kept`` (an ended session's id whose KV a hop keeps), ``hidden`` (the
model's hidden size), ``vocab`` and ``context``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import threading
import time

import msgpack
import torch
import zmq

from fabric.compute.tensors import to_wire
from fabric.wire import protocol as p
from fabric.wire.liveness import TOPIC_EVENTS

LISTEN_S = 0.4  # how long an attack waits for answers


class Rogue:
    def __init__(self, tracker: str, pub: str):
        self.ctx = zmq.Context.instance()
        self.tracker = tracker
        self.router = self.ctx.socket(zmq.ROUTER)  # where hops answer sessions the rogue names itself the head of
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.events: list[dict] = []  # the public feed, as any process may read it
        self._sub = self.ctx.socket(zmq.SUB)
        self._sub.connect(pub)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC_EVENTS)
        self._dealers: dict[str, zmq.Socket] = {}
        threading.Thread(target=self._read_feed, daemon=True).start()

    def _read_feed(self) -> None:
        while True:
            _, payload = self._sub.recv_multipart()
            self.events.append(msgpack.unpackb(payload, raw=False))

    # -- what the feed tells --------------------------------------------------------------

    def victim(self) -> tuple[str, list[p.Hop]]:
        """The key and route of the latest request the feed shows with a route."""
        for event in reversed(self.events):
            if event.get("hops") and event.get("key"):
                hops = [p.Hop(h["node"], h["endpoint"], h["start_layer"], h["end_layer"], h.get("key", ""))
                        for h in event["hops"]]
                return event["key"], hops
        raise LookupError("the feed showed no request with a route yet")

    # -- sending and listening ------------------------------------------------------------

    def send(self, endpoint: str, message: p.Message, tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self._dealer(endpoint).send_multipart(_encoded(message, tensors))

    def send_batch(self, endpoint: str, messages: list[tuple[p.Message, tuple[torch.Tensor, ...]]]) -> None:
        """``messages`` as BATCHes, each of MAX_BATCH at most, as a node sends a pass's messages to a peer."""
        for at in range(0, len(messages), p.MAX_BATCH):
            bodies = [_encoded(message, tensors) for message, tensors in messages[at:at + p.MAX_BATCH]]
            self._dealer(endpoint).send_multipart(p.encode_batch(bodies))

    def _dealer(self, endpoint: str) -> zmq.Socket:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._dealers[endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        return sock

    def listen(self, seconds: float = LISTEN_S) -> list[dict]:
        """Every frame that came back within ``seconds``: its kind and header fields."""
        poller = zmq.Poller()
        for sock in [self.router, *self._dealers.values()]:
            poller.register(sock, zmq.POLLIN)
        got, until = [], time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000)):
                frames = sock.recv_multipart()
                body = frames[1:] if sock is self.router else frames
                try:
                    msg, _ = p.decode(body)
                except p.ProtocolError as exc:
                    got.append({"kind": "undecodable", "why": str(exc)})
                    continue
                got.append({"kind": type(msg).__name__, **_summary(msg)})
        return got


def _encoded(message: p.Message, tensors: tuple[torch.Tensor, ...]) -> list:
    wired = [to_wire(t) for t in tensors]
    return p.encode(dataclasses.replace(message, tensors=tuple(s for s, _ in wired)), [b for _, b in wired])


def _summary(msg: p.Message) -> dict:
    fields = ("code", "message", "text", "session", "event", "request_id", "token", "error_code", "finish_reason")
    return {f: getattr(msg, f) for f in fields if isinstance(getattr(msg, f, None), (str, int))}


def main() -> None:
    from .attacks import ATTACKS

    parser = argparse.ArgumentParser(description="a rogue member of a meshnet swarm, driven over stdin")
    parser.add_argument("--tracker", required=True)
    parser.add_argument("--pub", required=True)
    args = parser.parse_args()
    rogue = Rogue(args.tracker, args.pub)
    print(json.dumps({"ready": rogue.endpoint}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            result = ATTACKS[cmd["attack"]](rogue, cmd)
        except Exception as exc:  # report, do not die: the next command still runs
            result = {"failed": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"attack": cmd["attack"], **result}, default=str), flush=True)


def new_id() -> str:
    return secrets.token_hex(16)


if __name__ == "__main__":
    main()
