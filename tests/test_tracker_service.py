"""The tracker over real ZeroMQ sockets on random loopback ports, in a thread."""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from fabric.cli.status_view import format_status
from fabric.wire.protocol import (
    MAGIC,
    Ack,
    Assign,
    AssignRequest,
    Error,
    Forward,
    Heartbeat,
    Hop,
    Kind,
    Ping,
    Pong,
    ProtocolError,
    Register,
    Report,
    Route,
    RouteRequest,
    Status,
    StatusRequest,
    TensorSpec,
    decode,
    encode,
    split_envelope,
)
from tests.support import FakeClock, wait_for
from tracker.service import Tracker, TrackerConfig

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 5.0


@pytest.fixture
def context():
    """A context whose sockets are all closed with linger=0, then terminated (bounded)."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
    assert ctx.closed


class Peer:
    """A DEALER talking to the tracker the way nodes and clients do."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send_raw(self, frames: list[bytes]):
        self.sock.send_multipart(frames)
        return self.recv()

    def call(self, message):
        return self.send_raw(encode(message))

    def recv(self):
        assert self.sock.poll(TIMEOUT * 1000), "the tracker did not answer"
        _, body = split_envelope(self.sock.recv_multipart())
        message, _ = decode(body)
        return message

    def status(self) -> dict:
        reply = self.call(StatusRequest())
        assert isinstance(reply, Status)
        return reply.body


class Running:
    """A tracker thread; ``stop()`` ends it and checks the thread really finished."""

    def __init__(self, tmp_path: Path, context: zmq.Context, clock=time.monotonic, **overrides):
        fields = dict(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*",
                      db=tmp_path / "ledger.sqlite3", heartbeat_interval=0.2, stats_interval=0.1, warmup=0)
        self.tracker = Tracker(TrackerConfig(**{**fields, **overrides}), clock=clock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.tracker.run, args=(self._stop,),
                                        name="tracker-under-test")
        self._thread.start()
        assert self.tracker.ready.wait(TIMEOUT), "the tracker did not bind"
        self.peer = Peer(context, self.tracker.endpoint)

    def stop(self) -> None:
        self.peer.sock.close(linger=0)
        self._stop.set()
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive(), "the tracker did not stop"


@pytest.fixture
def start(tmp_path, context):
    running: list[Running] = []

    def _start(**overrides) -> Running:
        running.append(Running(tmp_path, context, **overrides))
        return running[-1]

    yield _start
    for r in running:
        r.stop()


def register(node_id: str, start: int, end: int, bench: float = 100.0, **kw) -> Register:
    fields = dict(node_id=node_id, endpoint=f"tcp://127.0.0.1:{7000 + start}", model="m",
                  fingerprint="f", num_layers=30, start_layer=start, end_layer=end,
                  benchmark=bench, hardware={"device": "cpu"})
    return Register(**{**fields, **kw})


HOPS = (Hop("a", "tcp://127.0.0.1:7000", 0, 14), Hop("b", "tcp://127.0.0.1:7015", 15, 29))


def report(rid: str, tokens: int, elapsed: float, final: bool, reason: str | None = None,
           route=HOPS) -> Report:
    return Report(request_id=rid, node_id="a", model="m", route=route, prompt_tokens=7,
                  completion_tokens=tokens, elapsed=elapsed, final=final, finish_reason=reason,
                  api_key="sk-test", max_tokens=64)


def test_nodes_with_different_weights_are_reported_once(start, caplog):
    peer = start().peer
    with caplog.at_level("WARNING", logger="tracker.service"):
        peer.call(register("a", 0, 14, fingerprint="4d87456e"))
        peer.call(register("b", 15, 29, fingerprint="319a3d2a"))
        for _ in range(3):  # heartbeats and status calls do not repeat the warning
            peer.call(Heartbeat(node_id="a"))
            status = peer.status()
    assert status["plans"]["m"] == [] and status["gaps"]["m"]
    groups = status["weights_differ"]["m"]
    assert sorted(n["id"] for g in groups for n in g["nodes"]) == ["a", "b"]
    assert {g["fingerprint"] for g in groups} == {"4d87456e", "319a3d2a"}
    warned = [r.getMessage() for r in caplog.records if "weights differ" in r.getMessage()]
    assert len(warned) == 1 and "a [0-14]" in warned[0] and "b [15-29]" in warned[0]
    assert [e for e in status["events"] if e.get("code") == "weights_differ"]
    shown = format_status(status)  # what `meshnet status` prints
    assert "weights differ" in shown and "a [0-14]" in shown and "b [15-29]" in shown
    missing = peer.call(RouteRequest(model="m"))
    assert isinstance(missing, Error) and "weights differ" in missing.message
    peer.call(register("b", 15, 29, fingerprint="4d87456e"))  # b loads the same file again
    assert peer.status()["weights_differ"] == {} and len(peer.status()["plans"]["m"]) == 1


def test_register_two_nodes_and_route(start):
    peer = start().peer
    assert isinstance(peer.call(register("a", 0, 14)), Ack)
    assert isinstance(peer.call(register("b", 15, 29)), Ack)
    route = peer.call(RouteRequest(model="m"))
    assert isinstance(route, Route) and route.model == "m"
    assert [(h.node, h.start_layer, h.end_layer) for h in route.hops] == [("a", 0, 14), ("b", 15, 29)]
    assert route.hops[1].endpoint == "tcp://127.0.0.1:7015" and route.estimated_tps > 0
    unknown = peer.call(RouteRequest(model="nope"))
    assert isinstance(unknown, Error) and unknown.code == "unknown_model"
    missing = peer.call(RouteRequest(model="m", exclude=("b",)))
    assert isinstance(missing, Error) and missing.code == "no_route"
    assert "15-29" in missing.message and "b (excluded)" in missing.message


def test_status_shape(start):
    peer = start().peer
    peer.call(register("a", 0, 14))
    peer.call(register("b", 15, 29, max_sessions=4))
    peer.call(Heartbeat(node_id="b", sessions=2, queued=1))
    peer.call(RouteRequest(model="m"))
    body = json.loads(json.dumps(peer.status()))  # JSON-friendly end to end
    assert {"nodes", "plans", "events", "stats", "usage", "tracker"} <= set(body)
    nodes = {n["id"]: n for n in body["nodes"]}
    assert set(nodes) == {"a", "b"}
    b = nodes["b"]
    assert b["endpoint"] == "tcp://127.0.0.1:7015" and b["model"] == "m" and b["layers"] == [15, 29]
    assert (b["sessions"], b["queued"], b["max_sessions"]) == (2, 1, 4)
    (plan,) = body["plans"]["m"]
    assert plan["estimated_tps"] > 0
    assert plan["hops"] == [
        {"node": "a", "endpoint": "tcp://127.0.0.1:7000", "start_layer": 0, "end_layer": 14},
        {"node": "b", "endpoint": "tcp://127.0.0.1:7015", "start_layer": 15, "end_layer": 29}]
    (selected,) = [e for e in body["events"] if e["kind"] == "route selected"]
    assert [(h["start_layer"], h["end_layer"]) for h in selected["hops"]] == [(0, 14), (15, 29)]
    assert body["stats"]["counts"]["completions"] == 0
    assert body["usage"]["totals"]["billed"]["requests"] == 0


def test_heartbeat_expiry(start):
    clock = FakeClock()
    running = start(heartbeat_interval=1.0, expiry_missed=3, clock=clock)  # expiry after 3 s of silence
    peer = running.peer
    peer.call(register("a", 0, 29))
    peer.call(register("b", 0, 29))
    for _ in range(4):  # 4 s: b heartbeats every second, a says nothing
        clock.now += 1.0
        assert isinstance(peer.call(Heartbeat(node_id="b")), Ack)
    assert wait_for(lambda: [n["id"] for n in peer.status()["nodes"]] == ["b"], TIMEOUT)  # a is gone
    clock.now += 2.9  # b's silence is still short of its expiry
    assert [n["id"] for n in peer.status()["nodes"]] == ["b"]
    clock.now += 0.2
    assert wait_for(lambda: peer.status()["nodes"] == [], TIMEOUT)
    body = peer.status()
    assert body["plans"] == {}
    assert sum(e["kind"] == "error" and "expired" in e["message"] for e in body["events"]) == 2
    late = peer.call(Heartbeat(node_id="b"))
    assert isinstance(late, Error) and late.code == "unknown_node"


def test_unknown_node_heartbeat_asks_to_register(start):
    peer = start().peer
    reply = peer.call(Heartbeat(node_id="ghost", sessions=1))
    assert isinstance(reply, Error) and reply.code == "unknown_node" and reply.node == "ghost"
    assert isinstance(peer.call(register("ghost", 0, 29)), Ack)
    assert isinstance(peer.call(Heartbeat(node_id="ghost", sessions=1)), Ack)
    assert peer.status()["nodes"][0]["sessions"] == 1


def _header(**fields) -> bytes:
    return msgpack.packb({**fields, "tensors": []})


BAD_FRAMES = [
    ([b"garbage"], "bad_frame"),
    ([b""], "bad_frame"),
    ([MAGIC, bytes([99]), _header()], "bad_frame"),  # unknown kind
    ([MAGIC, b"\x14\x14", _header()], "bad_frame"),  # kind is not one byte
    ([b"MESH9", bytes([Kind.REGISTER]), _header()], "version"),
    ([MAGIC, bytes([Kind.REGISTER]), b"\xc1not msgpack"], "bad_frame"),
    ([MAGIC, bytes([Kind.REGISTER]), msgpack.packb([1, 2])], "bad_frame"),  # not a map
    ([MAGIC, bytes([Kind.HEARTBEAT]), _header(node_id=5)], "bad_frame"),  # wrong type
    ([MAGIC, bytes([Kind.HEARTBEAT]), _header(node_id="a", extra=1)], "bad_frame"),
    ([MAGIC, bytes([Kind.REGISTER]), _header(node_id="a")], "bad_frame"),  # missing fields
    ([MAGIC, bytes([Kind.HEARTBEAT]), _header(node_id="a"), b"\0" * 8], "bad_frame"),
    (encode(register("a", 5, 99)), "bad_request"),  # layers outside the model
    (encode(Forward(session="s", step=0, pos=0, start_layer=0, end_layer=1, route=(),
                    reply_to="x", tensors=(TensorSpec("int64", (1, 1)),)), [b"\0" * 8]),
     "bad_frame"),  # a tensor-carrying frame: the tracker takes no buffers
    (encode(Ping(nonce=1))[:2], "bad_frame"),  # truncated
    (encode(Assign(start_layer=0, end_layer=1)), "bad_request"),  # not a tracker request
    (encode(Report(request_id="", node_id="a", model="m", final=True)), "bad_request"),
    (encode(AssignRequest(model="m", num_layers=0)), "bad_request"),
]


@pytest.mark.parametrize("frames, code", BAD_FRAMES)
def test_malformed_frames_get_an_error_and_the_tracker_carries_on(start, frames, code):
    peer = start().peer
    reply = peer.send_raw(frames)
    assert isinstance(reply, Error) and reply.code == code, reply
    assert isinstance(peer.call(Ping(nonce=7)), Pong)
    assert isinstance(peer.call(register("a", 0, 29)), Ack)
    assert [n["id"] for n in peer.status()["nodes"]] == ["a"]


def test_a_req_style_delimiter_is_echoed(start):
    peer = start().peer
    peer.sock.send_multipart([b"", *encode(Ping(nonce=3))])
    assert peer.sock.poll(TIMEOUT * 1000)
    envelope, body = split_envelope(peer.sock.recv_multipart())
    assert envelope == [b""] and decode(body)[0] == Pong(nonce=3, node="tracker")


def test_auto_assignment(start):
    peer = start().peer
    assert peer.call(AssignRequest(model="m", num_layers=30, max_layers=15)) == \
        Assign(start_layer=0, end_layer=14)
    peer.call(register("a", 0, 14))
    assert peer.call(AssignRequest(model="m", num_layers=30, max_layers=15)) == \
        Assign(start_layer=15, end_layer=29)
    assert peer.call(AssignRequest(model="m", num_layers=30)) == Assign(start_layer=0, end_layer=29)


class Subscriber:
    def __init__(self, context: zmq.Context, endpoint: str):
        self.sock = context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def until(self, predicate) -> tuple[bytes, dict]:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                topic, payload = self.sock.recv_multipart()
                message = (topic, msgpack.unpackb(payload))
                if predicate(*message):
                    return message
        raise AssertionError("expected publication did not arrive")


def test_reports_become_events_stats_and_ledger_rows(start, context):
    running = start()
    peer = running.peer
    sub = Subscriber(context, running.tracker.pub_endpoint)
    sub.until(lambda topic, _: topic == b"stats")  # the subscription is live
    peer.call(register("a", 0, 14))
    _, plans = sub.until(lambda topic, p: topic == b"plans" and p["plans"])
    assert plans["plans"] == {"m": []} and plans["gaps"] == {"m": [[15, 29]]}
    peer.call(register("b", 15, 29))
    _, plans = sub.until(lambda topic, p: topic == b"plans" and p["plans"]["m"])
    assert [h["node"] for h in plans["plans"]["m"][0]["hops"]] == ["a", "b"]

    for tokens, elapsed in ((0, 0.1), (2, 0.5), (6, 0.9), (20, 2.3)):
        assert isinstance(peer.call(report("r1", tokens, elapsed, final=False)), Ack)
    _, event = sub.until(lambda t, e: t == b"events" and e["kind"] == "progress" and e["tokens"] == 20)
    assert event["tps"] == pytest.approx(10.0) and event["key"] == "r1" and event["queue"] == 0
    done = peer.call(report("r1", 24, 2.7, final=True, reason="stop"))
    assert done == Ack(detail="billed", request_id="r1")  # named: the node stops sending it again
    _, event = sub.until(lambda t, e: t == b"events" and e["kind"] == "complete")
    assert (event["completion_tokens"], event["billing"], event["duration"]) == (24, "billed", 2.7)

    held = peer.call(report("r2", 1, 0.2, final=True, reason="stop"))
    assert held.detail.startswith("held (suspiciously short")
    assert isinstance(peer.call(report("r3", 0, 0.1, final=True, reason="error")), Ack)
    body = peer.status()
    kinds = [e["kind"] for e in body["events"] if e.get("key") == "r1"]
    assert kinds == ["connected", "progress", "complete"]  # progress updated in place
    assert body["events"][-1]["kind"] == "error" and body["events"][-1]["key"] == "r3"
    stats = body["stats"]
    assert stats["counts"] == {"completions": 3, "fed": 1, "too_short": 1, "errors": 1}
    assert stats["ttft"][0]["seconds"] == pytest.approx(0.4)  # 2 tokens at 0.5 s, 0.1 s/token
    assert {r["node"] for r in stats["layer_steps_per_s"]} == {"a", "b"}
    assert body["usage"]["totals"]["billed"]["completion_tokens"] == 24
    assert body["usage"]["totals"]["held"]["requests"] == 1
    assert body["usage"]["by_node"]["b"]["completion_tokens"] == 24


def test_restart_with_the_same_db_keeps_the_ledger(start):
    first = start()
    first.peer.call(register("a", 0, 29))
    route = (Hop("a", "tcp://127.0.0.1:7000", 0, 29),)
    assert first.peer.call(report("r1", 30, 3.0, final=True, reason="stop", route=route)).detail == "billed"
    first.stop()
    second = start()
    body = second.peer.status()
    assert body["nodes"] == [] and body["usage"]["totals"]["billed"]["requests"] == 1
    again = second.peer.call(report("r1", 30, 3.0, final=True, reason="stop", route=route))
    assert again.detail == "already recorded: billed"
    assert second.peer.status()["usage"]["totals"]["billed"]["completion_tokens"] == 30
    # The restarted tracker learns the topology again from the nodes themselves.
    assert second.peer.call(Heartbeat(node_id="a")).code == "unknown_node"
    assert isinstance(second.peer.call(register("a", 0, 29)), Ack)
    assert second.peer.call(RouteRequest(model="m")).hops[0].node == "a"


def _read_until(proc: subprocess.Popen, needle: str) -> str:
    selector = selectors.DefaultSelector()
    selector.register(proc.stderr, selectors.EVENT_READ)
    seen, deadline = "", time.monotonic() + 10
    while needle not in seen and time.monotonic() < deadline:
        if selector.select(timeout=0.2):
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
    selector.close()
    assert needle in seen, seen
    return seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_cleanly_on_a_signal_without_torch(tmp_path, sig):
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from tracker.service import TrackerConfig, serve\n"
        "serve(TrackerConfig(bind='tcp://127.0.0.1:*', pub='tcp://127.0.0.1:*', db=sys.argv[1]))\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "l.sqlite3")],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _read_until(proc, "tracker listening on tcp://127.0.0.1:")
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
        assert "tracker stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


# --------------------------------------------------------------------------- round trips, relays, predictions


def test_heartbeats_list_peers_to_probe_and_measured_links_steer_the_plan(start):
    peer = start().peer
    peer.call(register("a", 0, 14, 2000.0))
    peer.call(register("b", 15, 29, 2000.0))
    peer.call(register("c", 0, 29, 1400.0))
    peer.call(register("other", 0, 29, model="x"))
    peer.call(register("mid", 10, 12, 2000.0))  # a hop of a could hand off to it; b never could
    assert [h["node"] for h in peer.status()["plans"]["m"][0]["hops"]] == ["a", "b"]  # links unknown: 2 ms
    ack = peer.call(Heartbeat(node_id="a", rtts={"b": 60.0, "c": 60.0}))
    assert isinstance(ack, Ack)
    assert {(h.node, h.endpoint) for h in ack.probe} == {("b", "tcp://127.0.0.1:7015"), ("c", "tcp://127.0.0.1:7000"),
                                                         ("mid", "tcp://127.0.0.1:7010")}
    assert {h.node for h in peer.call(Heartbeat(node_id="b")).probe} == {"a", "c"}  # not mid: 10-12 ends before 15
    body = peer.status()
    nodes = {n["id"]: n for n in body["nodes"]}
    assert nodes["a"]["rtts"] == {"b": 60.0, "c": 60.0} and nodes["b"]["rtts"] == {}
    assert [h["node"] for h in body["plans"]["m"][0]["hops"]] == ["c"]  # 30 ms each way: one node wins
    route = peer.call(RouteRequest(model="m"))
    assert [h.node for h in route.hops] == ["c"]


def test_a_relayed_node_is_marked_in_status_and_plans(start):
    peer = start().peer
    peer.call(register("a", 0, 14))
    peer.call(register("b", 15, 29, endpoint="tcp://relay:40001", relay="tcp://relay:5557"))
    body = peer.status()
    nodes = {n["id"]: n for n in body["nodes"]}
    assert (nodes["b"]["relayed"], nodes["b"]["relay"]) == (True, "tcp://relay:5557")
    assert (nodes["a"]["relayed"], nodes["a"]["relay"]) == (False, "")
    hops = body["plans"]["m"][0]["hops"]
    assert hops[1] == {"node": "b", "endpoint": "tcp://relay:40001", "start_layer": 15, "end_layer": 29,
                       "relay": "tcp://relay:5557"} and "relay" not in hops[0]


def test_plans_show_predicted_and_actual_tokens_per_second(start, context):
    running = start()
    peer = running.peer
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats")
    sub.connect(running.tracker.pub_endpoint)
    peer.call(register("a", 0, 14))
    peer.call(register("b", 15, 29))
    (plan,) = peer.status()["plans"]["m"]
    assert plan["actual_tps"] is None and plan["samples"] == 0
    hops = tuple(Hop(h["node"], h["endpoint"], h["start_layer"], h["end_layer"]) for h in plan["hops"])
    peer.call(report("r1", 20, 2.0, final=True, reason="length", route=hops))
    (plan,) = peer.status()["plans"]["m"]
    assert plan["samples"] == 1 and plan["actual_tps"] == pytest.approx(10.0)
    assert plan["estimated_tps"] > 0
    (row,) = peer.status()["stats"]["routes"]
    assert row["actual_tps"] == pytest.approx(10.0) and row["predicted_tps"] > 0
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:  # the same rows go out on the stats topic
        assert sub.poll(TIMEOUT * 1000)
        _, payload = sub.recv_multipart()
        routes = msgpack.unpackb(payload)["stats"]["routes"]
        if routes:
            assert routes[0]["actual_tps"] == pytest.approx(10.0)
            break
    else:
        pytest.fail("no stats publication with the route")
    sub.close(linger=0)


def test_secured_tracker_gives_a_relayed_node_its_relays_key_if_allow_listed(tmp_path):
    from fabric.net.security import create_keys, load

    create_keys(tmp_path / "swarm", "swarm", tracker=True)
    create_keys(tmp_path / "stranger", "stranger")
    security = load(tmp_path / "swarm")
    tracker = Tracker(TrackerConfig(db=":memory:", security=security))
    relay_key, node_key = security.public_text, "n" * 40
    stranger_key = load(tmp_path / "stranger").public_text
    relayed = register("b", 15, 29, endpoint="tcp://relay:40001", relay="tcp://relay:5557")
    for key, why in (("", "must name its relay's key"), (stranger_key, "not on the tracker's allow-list")):
        with pytest.raises(ProtocolError, match=why):
            tracker.handle(Register(**{**relayed.__dict__, "relay_key": key}), node_key)
    assert isinstance(tracker.handle(Register(**{**relayed.__dict__, "relay_key": relay_key}), node_key), Ack)
    assert isinstance(tracker.handle(register("a", 0, 14), "a" * 40), Ack)
    (route,) = tracker.status_body()["plans"]["m"]
    assert [h["key"] for h in route["hops"]] == ["a" * 40, relay_key]  # peers dial b's front with the relay's key


def test_the_tracker_checks_that_it_can_reach_each_registered_endpoint(start, context):
    running = start(reach_timeout=0.5)
    peer = running.peer
    answering = context.socket(zmq.ROUTER)  # stands in for a node: answers any frame
    answering.setsockopt(zmq.LINGER, 0)
    port = answering.bind_to_random_port("tcp://127.0.0.1")
    closed = f"tcp://127.0.0.1:{_free_port()}"  # nobody listens there
    peer.call(register("up", 0, 29, endpoint=f"tcp://127.0.0.1:{port}"))
    peer.call(register("natted", 0, 29, endpoint=closed))
    assert answering.poll(TIMEOUT * 1000)
    identity, *body = answering.recv_multipart()
    assert isinstance(decode(body)[0], Ping)
    answering.send_multipart([identity, *encode(Pong(1, node="up"))])
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:  # heartbeats keep both registered meanwhile
        acks = {name: peer.call(Heartbeat(node_id=name)) for name in ("up", "natted")}
        nodes = {n["id"]: n for n in peer.status()["nodes"]}
        if nodes["up"]["reachable"] is not None and nodes["natted"]["reachable"] is not None:
            break
        time.sleep(0.05)
    assert (nodes["up"]["reachable"], nodes["natted"]["reachable"]) == (True, False)
    acks = {name: peer.call(Heartbeat(node_id=name)) for name in ("up", "natted")}
    assert (acks["up"].reachable, acks["natted"].reachable) == (True, False)
    assert any(e.get("code") == "unreachable" and e.get("node") == "natted" for e in peer.status()["events"])
    answering.close(linger=0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_speculation_shows_per_request_and_per_route(start, context):
    """A head's REPORTs carry a request's decode trips, drafts sent and drafts kept: the progress
    and completion events give the share kept and tokens per trip (the dashboard's Call wall),
    and completions add up per route in status (`meshnet status`), in the stats feed (the swarm
    view) and in /metrics. A request that drafted nothing adds nothing; counts that cannot be
    are refused."""
    import dataclasses

    running = start()
    peer = running.peer
    sub = Subscriber(context, running.tracker.pub_endpoint)
    sub.until(lambda topic, _: topic == b"stats")
    peer.call(register("a", 0, 14))
    peer.call(register("b", 15, 29))
    drafts = dict(trips=10, drafted=20, kept=15)  # 10 trips gave 25 tokens
    assert isinstance(peer.call(dataclasses.replace(report("r1", 8, 0.5, final=False), **drafts)), Ack)
    _, event = sub.until(lambda t, e: t == b"events" and e["kind"] == "progress")
    assert (event["acceptance"], event["tokens_per_trip"]) == (0.75, 2.5) and "75% of drafts kept" in event["message"]
    peer.call(dataclasses.replace(report("r1", 25, 1.0, final=True, reason="stop"), **drafts))
    peer.call(dataclasses.replace(report("r2", 30, 1.0, final=True, reason="stop"), trips=30, drafted=10, kept=0))
    peer.call(report("r3", 30, 1.0, final=True, reason="stop"))  # no drafts: not counted
    _, event = sub.until(lambda t, e: t == b"events" and e["kind"] == "complete" and e["key"] == "r2")
    assert (event["acceptance"], event["tokens_per_trip"]) == (0.0, 1.0)
    body = peer.status()
    (route,) = body["speculation"]["m"]
    assert route == {"route": ["a", "b"], "requests": 2, "trips": 40, "drafted": 30, "kept": 15,
                     "acceptance": 0.5, "tokens_per_trip": 1.375}
    assert "speculation a -> b: 2 requests, 50% of drafts kept, 1.38 tokens a trip" in format_status(body)
    _, stats = sub.until(lambda t, s: t == b"stats" and s.get("speculation", {}).get("m"))
    assert stats["speculation"]["m"][0]["tokens_per_trip"] == 1.375
    rows = {(s.name, s.labels.get("route")): s.value for s in running.tracker.metrics()}
    assert rows[("tracker_route_spec_kept_total", "a>b")] == 15
    assert rows[("tracker_route_spec_tokens_per_trip", "a>b")] == 1.375
    for wrong in (dict(trips=1, drafted=2, kept=3), dict(trips=1, drafted=20, kept=9), dict(trips=-1)):
        refused = peer.call(dataclasses.replace(report("r4", 5, 1.0, final=False), **wrong))
        assert isinstance(refused, Error) and refused.code == "bad_request", refused
