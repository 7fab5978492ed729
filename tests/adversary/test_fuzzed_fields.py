"""Every field of every message kind, fuzzed, from a stranger: a swarm answers each with an error at
most, logs nothing worse than a warning, and serves honest streams as before.

Each valid sample of tests/test_protocol.py is sent again with one field of its header (or of a
map or hop inside it) replaced by an extreme value of its type (0, -1, 2**63 - 1, a subnormal or
the largest float, an empty, huge or control-character string, an endpoint) or by a value of
another type, to every node and to the tracker, from a DEALER that never registered. A mutant
the wire refuses costs an ERROR reply; one it accepts must be handled as the hostile input it
may be. Every fourth mutant also travels in a BATCH, as a peer sends a pass's messages, and in
one whose counts do not add up to the frames that follow. The values come from a seeded
generator: a failure names the mutant, and repeats.
"""
from __future__ import annotations

import logging
import random

import msgpack
import zmq

from fabric.wire import protocol as p
from tests.cluster import ThreadCluster
from tests.test_protocol import SAMPLES

INTS = [0, -1, 1, 7, 2**31, -2**31, 2**63 - 1, -2**63, 2**64 - 1]
FLOATS = [0.0, -1.0, 1e308, 5e-324, -0.0, 1e-300]
STRINGS = ["", "x" * 5000, "\x00", "tcp://127.0.0.1:9", "ipc:///tmp/meshnet-fuzz", "../../etc/passwd", "é" * 10]
OTHERS = [None, True, [], {}, [[[]]], {"a": [1, 2]}, b"\xff" * 8]
PROMPTS = ["the quick brown fox", "hello world, how are you"]


def values_for(value, rng: random.Random) -> list:
    """Extreme values of ``value``'s type, and two of other types."""
    if isinstance(value, bool):
        pool = [not value, 0, 1, None]
    elif isinstance(value, int):
        pool = INTS + ["1", 1.5]
    elif isinstance(value, float):
        pool = FLOATS + [1]
    elif isinstance(value, str):
        pool = STRINGS + [0]
    elif isinstance(value, list):
        pool = [[], value * 50 if value else [0] * 50, [value], [None] * 3] + ([[value[0]] * 300] if value else [])
    elif isinstance(value, dict):
        pool = [{}, {k: None for k in value}, {"zz": 1}]
    else:
        pool = INTS[:3] + STRINGS[:2]
    return pool + rng.sample(OTHERS, 2)


def nested(value, rng: random.Random) -> list:
    """Mutants of the maps a field holds (a route's hops, a sampling's settings), one key at a time."""
    out = []
    if isinstance(value, dict):
        for key in value:
            out += [{**value, key: x} for x in values_for(value[key], rng)[:5]]
    elif isinstance(value, list):
        for i, item in enumerate(value[:3]):
            for changed in nested(item, rng) if isinstance(item, dict) else []:
                out.append([*value[:i], changed, *value[i + 1:]])
    return out


def mutants(rng: random.Random):
    """(what changed, frames) for every sample message with one field changed."""
    for message, buffers in SAMPLES:
        frames = p.encode(message, buffers)
        header = msgpack.unpackb(frames[2], raw=False)
        for name, value in header.items():
            if name == "tensors":
                continue
            for x in values_for(value, rng) + nested(value, rng):
                packed = msgpack.packb({**header, name: x}, use_bin_type=True)
                yield f"{type(message).__name__}.{name} = {x!r:.60}", [frames[0], frames[1], packed, *frames[3:]]


def batched(frames: list, i: int) -> list[list]:
    """Every fourth mutant also as a node's peer would send a pass's messages: in a BATCH beside a
    PING, and in one whose counts do not add up to the frames that follow."""
    if i % 4:
        return []
    ping = p.encode(p.Ping(i))
    wrong = msgpack.packb({"counts": [len(frames) + 1]})
    return [p.encode_batch([frames, ping]), [p.MAGIC, bytes([p.BATCH_KIND]), wrong, *frames, *ping]]


def send_to_all(socks: list[zmq.Socket], frames: list, i: int, flags: int = 0) -> None:
    """The ``i``-th mutant, and its BATCHes, to every socket; what came back is read and dropped.
    With ``flags`` NOBLOCK a full queue drops a frame instead of waiting."""
    for sock in socks:
        for each in [frames, *batched(frames, i)]:
            try:
                sock.send_multipart(each, flags)
            except zmq.Again:
                pass
        while sock.poll(0):
            sock.recv_multipart()


def drained(socks: list[zmq.Socket], nonce: int) -> bool:
    """Each target has read all it was sent: a PING to a node (a STATUS_REQUEST to the tracker, the
    last socket), sent after the mutants on the same socket, is answered within a minute."""
    for i, sock in enumerate(socks):
        tracker = i == len(socks) - 1
        sock.send_multipart(p.encode(p.StatusRequest() if tracker else p.Ping(nonce)))
        while True:
            if not sock.poll(60_000):
                return False
            msg, _ = p.decode(sock.recv_multipart())
            if isinstance(msg, p.Status if tracker else p.Pong) and (tracker or msg.nonce == nonce):
                break
    return True


def errors(caplog) -> list[str]:
    """What the swarm logged as an error, with the exception it caught."""
    return [f"{r.getMessage()}: {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
            for r in caplog.records if r.levelno >= logging.ERROR]


def test_fuzzed_fields_of_every_message_cost_a_swarm_nothing(tiny_models, caplog):
    model = tiny_models("llama")
    cluster = ThreadCluster()
    socks = []
    try:
        for name, (start, end) in {"h": (0, 1), "m": (2, 3), "t": (4, 5)}.items():
            cluster.add_node(model, start, end, 6, name, max_sessions=16, kv_idle_timeout=5.0)
        cluster.wait_routable(model.name, 3)
        before = cluster.stream_all(model.name, PROMPTS, 16)
        for endpoint in [node.endpoint for node in cluster.nodes.values()] + [cluster.endpoint]:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            socks.append(sock)
        sent = 0
        with caplog.at_level(logging.WARNING):
            for what, frames in mutants(random.Random(0)):
                send_to_all(socks, frames, sent)
                sent += 1
                if sent % 100 == 0:  # the swarm has read them all: a logged error names its hundred
                    assert drained(socks, sent), f"a target answers nothing after the 100 mutants up to {what}"
                    assert not errors(caplog), f"a mutant of the 100 up to {what}: {errors(caplog)}"
            assert drained(socks, sent + 1), "a target answers nothing after the last mutants"
            assert not errors(caplog), errors(caplog)
        assert sent > 3000
        assert cluster.stream_all(model.name, PROMPTS, 16) == before
        with cluster.client() as client:
            assert len(client.status()["nodes"]) == 3
    finally:
        for sock in socks:
            sock.close()
        cluster.close()
