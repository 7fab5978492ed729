"""The dashboard's server side: Call wall and throughput state, /api/status and /api/events.

/api/events is fed by a real PUB socket on a random loopback port standing in for the
tracker's, so the SUB side (connect, subscribe, decode, fan out, close) runs for real.
"""
from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import zmq
import zmq.asyncio

from fabric.wire.protocol import ErrorCode
from tests.support import free_port
from webui import WebUIConfig, create_app
from webui.board import CallBoard, ThroughputMeter
from webui.dashboard import LIVE_EXTENSION, stream
from webui.live import CLOSED, LiveFeed, decode
from webui.testing import FakeClient

HOPS = [{"node": "a", "endpoint": "tcp://x:1", "start_layer": 0, "end_layer": 2},
        {"node": "b", "endpoint": "tcp://x:2", "start_layer": 3, "end_layer": 5}]


def connected(key="r1", seq=1, ts=100.0):
    return {"id": seq, "seq": seq, "ts": ts, "updated": ts, "kind": "connected", "key": key,
            "message": "a connected for m", "node": "a", "model": "m", "hops": HOPS}


def progress(key="r1", seq=2, tokens=5, ts=101.0):
    return {"id": seq, "seq": seq, "ts": ts, "updated": ts, "kind": "progress", "key": key,
            "message": f"{tokens} tokens", "node": "a", "model": "m", "tokens": tokens, "tps": 12.5,
            "queue": 1, "elapsed": 0.4}


def complete(key="r1", seq=3, tokens=9, reason="stop", kind="complete", ts=102.0):
    return {"id": seq, "seq": seq, "ts": ts, "updated": ts, "kind": kind, "key": key, "message": "done",
            "node": "a", "model": "m", "prompt_tokens": 4, "completion_tokens": tokens, "duration": 0.8,
            "finish_reason": reason, "billing": "billed", "billing_reason": "", "hops": HOPS}


# --------------------------------------------------------------------------- CallBoard


def test_call_board_follows_a_request():
    board = CallBoard()
    row = board.apply(connected(), 0.0)
    assert row["state"] == "running" and row["model"] == "m" and row["tokens"] == 0
    assert [(h["node"], h["start_layer"], h["end_layer"]) for h in row["hops"]] == [("a", 0, 2), ("b", 3, 5)]
    row = board.apply(progress(), 0.0)
    assert (row["tokens"], row["tps"], row["queue"]) == (5, 12.5, 1)
    assert board.snapshot()["active"][0]["key"] == "r1"
    row = board.apply(complete(), 0.0)
    assert row["state"] == "complete" and row["tokens"] == 9 and row["billing"] == "billed"
    assert row["duration"] == 0.8 and row["prompt_tokens"] == 4
    snap = board.snapshot()
    assert snap["active"] == [] and [r["key"] for r in snap["recent"]] == ["r1"]


def test_call_board_ignores_repeats_late_events_and_junk():
    board = CallBoard()
    board.apply(connected(), 0.0)
    assert board.apply(progress(seq=2), 0.0) is not None
    assert board.apply(progress(seq=2), 0.0) is None  # the same event again (a status poll)
    board.apply(complete(), 0.0)
    assert board.apply(progress(seq=9, tokens=50), 0.0) is None  # late news of a finished request
    assert board.apply({"kind": "route selected", "key": None, "seq": 10}, 0.0) is None
    assert board.apply({"kind": "nonsense", "key": "r2"}, 0.0) is None
    assert board.apply({"kind": "progress", "key": "r3", "tokens": "many", "hops": "x"}, 0.0)["tokens"] == 0
    assert [r["key"] for r in board.snapshot()["active"]] == ["r3"]


@pytest.mark.parametrize("event, state", [
    (complete(reason="cancelled"), "cancelled"),
    (complete(reason="error", kind="error"), "error"),
    (complete(reason="length"), "complete"),
])
def test_call_board_final_states(event, state):
    board = CallBoard()
    board.apply(connected(), 0.0)
    assert board.apply(event, 0.0)["state"] == state


def test_call_board_expires_silent_requests():
    board = CallBoard(idle_timeout=10)
    board.apply(connected(), 100.0)
    board.apply(connected(key="r2"), 105.0)
    assert board.expire(109.0) == []
    lost = board.expire(111.0)
    assert [(r["key"], r["state"]) for r in lost] == [("r1", "lost")]
    assert [r["key"] for r in board.snapshot()["active"]] == ["r2"]


def test_completion_without_earlier_events_goes_straight_to_recent():
    board = CallBoard()
    assert board.apply(complete(key="quick"), 0.0)["state"] == "complete"
    assert board.snapshot()["active"] == []


# --------------------------------------------------------------------------- ThroughputMeter


def test_meter_counts_tokens_for_every_node_on_the_route():
    meter = ThroughputMeter()
    assert meter.sample(10.0, ["a", "b", "c"]) is None  # the first call only starts the clock
    meter.observe(connected())
    meter.observe(progress(tokens=4))
    meter.observe(progress(seq=3, tokens=4))  # no growth, nothing counted
    point = meter.sample(12.0, ["a", "b", "c"])
    assert point == {"ts": 12.0, "tps": {"a": 2.0, "b": 2.0, "c": 0.0}}
    meter.observe(complete(seq=4, tokens=10))  # 6 more
    meter.observe(complete(seq=4, tokens=10))  # the same completion from a status poll
    assert meter.sample(14.0, ["a", "b"])["tps"] == {"a": 3.0, "b": 3.0}
    assert len(meter.history) == 2


def test_meter_credits_the_head_until_the_route_is_known():
    meter = ThroughputMeter()
    meter.sample(0.0, [])
    meter.observe(progress(key="r9", tokens=3))
    assert meter.sample(1.0, [])["tps"] == {"a": 3.0}


# --------------------------------------------------------------------------- LiveFeed pieces


def test_decode_refuses_malformed_publications():
    good = msgpack.packb({"ts": 1.0})
    assert decode([b"stats", good]) == ("stats", {"ts": 1.0})
    assert decode([b"other", good]) is None
    assert decode([b"stats"]) is None
    assert decode([b"stats", b"\xc1"]) is None  # not msgpack
    assert decode([b"stats", msgpack.packb([1, 2])]) is None
    assert decode([b"stats", msgpack.packb({"raw": b"\x00"}, use_bin_type=True)]) is None


@pytest.mark.asyncio
async def test_stream_resynchronises_a_listener_that_fell_behind():
    feed = LiveFeed(None, queue_size=2)
    listener = feed.listen()
    body = stream(feed, listener, keepalive=5)
    first = await anext(body)
    assert first.startswith(b"event: hello\n")
    for seq in range(1, 6):
        feed.handle("events", connected(key=f"r{seq}", seq=seq))
    assert listener.dropped > 0
    again = await anext(body)
    assert again.startswith(b"event: hello\n")
    assert len(json.loads(again.split(b"data: ", 1)[1])["calls"]["active"]) == 5
    feed.unlisten(listener)
    assert await listener.get(1) is CLOSED
    await body.aclose()


@pytest.mark.asyncio
async def test_listeners_end_when_the_feed_stops():
    feed = LiveFeed(None)
    listener = feed.listen()
    await feed.stop()
    assert await listener.get(1) is CLOSED
    late = feed.listen()
    assert await late.get(1) is CLOSED


# --------------------------------------------------------------------------- /api/status


STATUS = {"tracker": {"expiry_s": 3.0}, "nodes": [{"id": "a", "model": "m", "layers": [0, 2]}],
          "plans": {"m": [{"hops": HOPS, "estimated_tps": 10.0}]}, "gaps": {},
          "events": [progress(), connected()], "stats": {}, "usage": {"by_key": {}}}


@pytest.mark.asyncio
async def test_api_status_adds_call_wall_and_feed_state():
    fake = FakeClient(status_body=STATUS)
    app = create_app(WebUIConfig(pub=None), fake)
    response = await app.test_client().get("/api/status")
    assert response.status_code == 200
    body = await response.get_json()
    assert body["nodes"] == STATUS["nodes"] and body["plans"] == STATUS["plans"]
    (row,) = body["calls"]["active"]
    assert row["key"] == "r1" and row["tokens"] == 5 and row["hops"][1]["node"] == "b"
    assert body["webui"]["feed"] == {"endpoint": None, "live": False, "received": 0, "error": None}
    assert body["webui"]["accounting"]["total"]["requests"] == 0 and body["webui"]["auth"] is False
    assert body["throughput"] == []  # the first poll only starts the meter's clock


@pytest.mark.asyncio
async def test_api_status_when_the_tracker_does_not_answer():
    app = create_app(WebUIConfig(pub=None), FakeClient(status_error=ErrorCode.INTERNAL))
    response = await app.test_client().get("/api/status")
    assert response.status_code == 503
    assert (await response.get_json())["error"]["code"] == "tracker_unavailable"


@pytest.mark.asyncio
async def test_api_needs_the_key_when_keys_are_configured():
    app = create_app(WebUIConfig(pub=None, api_keys=frozenset({"sk-1"})), FakeClient())
    client = app.test_client()
    response = await client.get("/api/status")
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert (await client.get("/api/events")).status_code == 401
    ok = await client.get("/api/status", headers={"Authorization": "Bearer sk-1"})
    assert ok.status_code == 200 and (await ok.get_json())["webui"]["auth"] is True


@pytest.mark.asyncio
async def test_unknown_api_path_is_a_json_error_and_the_page_is_served():
    client = create_app(WebUIConfig(pub=None), FakeClient()).test_client()
    response = await client.get("/api/nope")
    assert response.status_code == 404 and "error" in await response.get_json()
    page = await client.get("/")
    assert page.status_code == 200 and b'id="chat"' in await page.get_data()
    for asset in ("dashboard.css", "dashboard.js", "chat.js", "swarm.js", "net.js", "ui.js"):
        assert (await client.get(f"/static/{asset}")).status_code == 200, asset


# --------------------------------------------------------------------------- /api/events


@pytest.fixture
def pub():
    """A PUB socket standing in for the tracker's: (socket, endpoint)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(linger=0)


class EventReader:
    """Reads SSE events from a Quart test connection: (name, data) pairs."""

    def __init__(self, connection):
        self.connection = connection
        self.buffer = b""

    async def next(self) -> tuple[str | None, object]:
        while b"\n\n" not in self.buffer:
            self.buffer += await self.connection.receive()
        block, self.buffer = self.buffer.split(b"\n\n", 1)
        name, data = None, []
        for line in block.decode().split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line.startswith(":"):
                return "comment", line[1:].strip()
        return name, json.loads("\n".join(data))

    async def until(self, wanted: str, publish=None) -> object:
        """The data of the next ``wanted`` event, calling ``publish`` while waiting (slow joiner)."""
        async with asyncio.timeout(10):
            while True:
                if publish is not None:
                    await publish()
                try:
                    name, data = await asyncio.wait_for(self.next(), 0.1)
                except TimeoutError:
                    continue
                if name == wanted:
                    return data


async def open_events(test_client):
    connection = test_client.request("/api/events", method="GET")
    await connection.__aenter__()
    await connection.send_complete()
    return connection, EventReader(connection)


@pytest.mark.asyncio
async def test_api_events_relays_the_tracker_pub(pub):
    sock, endpoint = pub
    app = create_app(WebUIConfig(pub=endpoint), FakeClient())
    feed = app.extensions[LIVE_EXTENSION]

    async def send(topic: bytes, payload: dict) -> None:
        await sock.send_multipart([topic, msgpack.packb(payload, use_bin_type=True)])

    async with app.test_app() as test_app:
        connection, reader = await open_events(test_app.test_client())
        hello = await reader.until("hello")
        assert hello["feed"]["endpoint"] == endpoint and hello["calls"] == {"active": [], "recent": []}
        stats = {"ts": 1.0, "nodes": [{"id": "a"}, {"id": "b"}], "stats": {}, "usage": {}}
        assert (await reader.until("stats", lambda: send(b"stats", stats)))["nodes"][0]["id"] == "a"
        assert (await reader.until("accounting"))["total"]["requests"] == 0
        # Each topic is its own subscription, and the PUB may learn of them one at a time:
        # every topic is published until its first message arrives (slow joiner).
        plans = {"ts": 1.0, "version": 3, "plans": {"m": []}, "gaps": {}}
        assert (await reader.until("plans", lambda: send(b"plans", plans)))["version"] == 3
        assert (await reader.until("event", lambda: send(b"events", connected())))["kind"] == "connected"
        assert (await reader.until("call"))["state"] == "running"
        await send(b"events", complete(tokens=8))
        assert (await reader.until("call"))["state"] == "complete"
        await send(b"stats", {**stats, "ts": 3.0})
        assert (await reader.until("throughput")) == {"ts": 3.0, "tps": {"a": 4.0, "b": 4.0}}
        assert feed.live and feed.describe()["received"] >= 4
        await connection.disconnect()
        await connection.__aexit__(None, None, None)
        async with asyncio.timeout(5):
            while feed._listeners:
                await asyncio.sleep(0.01)
    assert feed._socket is None and feed._task is None


@pytest.mark.asyncio
async def test_api_events_without_a_feed_sends_keepalives():
    app = create_app(WebUIConfig(pub=None, sse_keepalive=0.05), FakeClient())
    async with app.test_app() as test_app:
        connection, reader = await open_events(test_app.test_client())
        assert (await reader.until("hello"))["feed"]["endpoint"] is None
        assert await reader.until("comment") == "keep-alive"
        await connection.disconnect()
        await connection.__aexit__(None, None, None)


@pytest.mark.asyncio
@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:{port}", "not an endpoint"])
async def test_app_serves_without_a_reachable_pub(endpoint):
    fake = FakeClient(status_body=STATUS)
    app = create_app(WebUIConfig(pub=endpoint.format(port=free_port())), fake)
    feed = app.extensions[LIVE_EXTENSION]
    async with app.test_app() as test_app:
        response = await test_app.test_client().get("/api/status")
        assert response.status_code == 200
        body = await response.get_json()
        assert body["webui"]["feed"]["live"] is False
        assert [r["key"] for r in body["calls"]["active"]] == ["r1"]
        assert (feed.error is not None) == (endpoint == "not an endpoint")
    assert feed._socket is None


@pytest.mark.asyncio
async def test_shutdown_ends_open_event_streams_cleanly():
    """Stopping the server ends /api/events at once (a complete chunked body), rather than
    leaving hypercorn to cut it off after its graceful timeout."""
    from webui.app import serve_async

    port, stop = free_port(), asyncio.Event()
    config = WebUIConfig(port=port, pub=f"tcp://127.0.0.1:{free_port()}")
    server = asyncio.create_task(serve_async(config, client_factory=lambda _: FakeClient(),
                                             shutdown_trigger=stop.wait))
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
        writer.write(b"GET /api/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        received = b""
        async with asyncio.timeout(10):
            while b"event: hello" not in received:
                received += await reader.read(65536)
        stop.set()
        async with asyncio.timeout(30):
            while chunk := await reader.read(65536):
                received += chunk
        writer.close()
        assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"0\r\n\r\n")
    finally:
        stop.set()
        await asyncio.wait_for(server, 30)
