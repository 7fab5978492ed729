"""The tracker is not needed to keep serving (issue 17, item 2).

Clients and the web UI route new requests on the routes they remember while the tracker
is away; a node keeps every final report until the tracker acknowledges it, so usage made
meanwhile reaches the ledger once; and no HTTP response is ever a 500 with an empty body.
Units first, then real processes: the tracker killed with SIGKILL and started again on its
port and ledger.
"""
from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import threading
import urllib.request

import pytest
import zmq

from fabric import Client, FabricError
from fabric.client.routes import RouteBook
from fabric.net.tracker_link import TrackerLink
from fabric.wire import protocol as p
from tests.support import FakeClock, free_port, wait_for
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy
from tracker.service import Tracker, TrackerConfig
from webui import WebUIConfig, create_app
from webui.live import LiveFeed
from webui.testing import FakeClient

A = p.Hop("a", "tcp://127.0.0.1:7001", 0, 2)
B = p.Hop("b", "tcp://127.0.0.1:7002", 3, 5)
C = p.Hop("c", "tcp://127.0.0.1:7003", 3, 5)


def plans_of(model: str, *routes: tuple[p.Hop, ...]) -> dict:
    """A ``plans`` publication as the tracker sends it."""
    return {"version": 3, "plans": {model: [{"hops": [{"node": h.node, "endpoint": h.endpoint,
                                                        "start_layer": h.start_layer, "end_layer": h.end_layer}
                                                       for h in route], "estimated_tps": 9.0}
                                            for route in routes]}}


# --------------------------------------------------------------------------- what a client remembers


def test_route_book_remembers_the_tracker_routes_and_avoids_the_dead():
    book = RouteBook()
    assert book.instead("m") is None
    book.learn_plans(plans_of("m", (A, B), (A, C)))
    assert book.instead("m") == (A, B)
    book.died("b")
    assert book.instead("m") == (A, C)
    assert book.instead("m", exclude=("c",)) is None
    assert book.models() == [{"id": "m", "num_layers": 6, "nodes": 3, "routable": True}]
    book.learn("m", (A, B))  # the tracker gave b again: it lives
    assert book.instead("m") == (A, B) and not book.dead
    book.learn_plans({"plans": {"m": []}})  # the tracker says nothing serves m now
    assert book.instead("m") is None and "m" not in book


def test_route_book_skips_malformed_plans():
    book = RouteBook()
    book.learn_plans({"plans": {"m": [{"hops": [{"node": "a"}]}, "x"], "n": 3}})
    book.learn_plans(["not", "a", "map"])
    assert book.instead("m") is None


def test_client_routes_on_a_remembered_route_while_the_tracker_is_silent():
    with Client(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as client:
        with pytest.raises(FabricError) as refused:
            client.route("m")
        assert refused.value.code == p.ErrorCode.TRACKER_UNAVAILABLE  # nothing remembered: the error stands
        client.learn_plans(plans_of("m", (A, B)))
        assert client.route("m") == (A, B)
        assert client.models() == [{"id": "m", "num_layers": 6, "nodes": 2, "routable": True}]
        with pytest.raises(FabricError) as refused:
            client.route("m", exclude=("a",))  # no remembered route avoids a
        assert refused.value.code == p.ErrorCode.TRACKER_UNAVAILABLE


def test_a_tracker_that_just_started_lets_clients_route_on_what_they_remember(ctx):
    tracker = Tracker(TrackerConfig(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*", db=":memory:",
                                    warmup=60), context=ctx)
    stop = threading.Event()
    thread = threading.Thread(target=tracker.run, args=(stop,), daemon=True)
    thread.start()
    assert tracker.ready.wait(10)
    try:
        with Client(tracker.endpoint, timeout=5) as client:
            with pytest.raises(FabricError) as refused:
                client.route("m")  # its nodes have not registered again yet, and nothing is remembered
            assert refused.value.code == p.ErrorCode.TRACKER_STARTING and "nodes register" in str(refused.value)
            client.learn_plans(plans_of("m", (A, B)))
            assert client.route("m") == (A, B)
    finally:
        stop.set()
        thread.join(10)


def test_the_web_ui_feed_hands_plans_to_the_client():
    seen = []
    feed = LiveFeed(None, on_plans=seen.append)
    feed.handle("plans", plans_of("m", (A, B)))
    feed.handle("stats", {"ts": 1.0, "nodes": []})
    assert seen == [plans_of("m", (A, B))]


# --------------------------------------------------------------------------- usage the tracker has not taken




def _final(rid: str) -> p.Report:
    return p.Report(request_id=rid, node_id="n", model="m", route=(A, B), prompt_tokens=3, completion_tokens=4,
                    elapsed=0.5, final=True, finish_reason="stop", max_tokens=4)


def _received(router: zmq.Socket) -> list[p.Message]:
    out = []
    while router.poll(200):
        out.append(p.decode(router.recv_multipart()[1:])[0])
    return out


def test_a_final_report_is_sent_again_until_the_tracker_acknowledges_it(ctx):
    """The tracker died with report r1 in a buffer: once a restarted tracker answers other
    messages, r1 goes again; an ACK naming it ends that, and r2, acknowledged at once, never goes twice."""
    clock, endpoint = FakeClock(), f"tcp://127.0.0.1:{free_port()}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    link = TrackerLink(ctx, endpoint, None, resend=3.0, clock=clock)
    try:
        link.send(_final("r1"))
        link.send(p.Report(request_id="r1", node_id="n", model="m"))  # progress: never kept
        assert [m.request_id for m in _received(router)] == ["r1", "r1"]  # ...then lost with the tracker
        assert list(link.unacked) == ["r1"]
        clock.now += 10
        link.check()
        assert _received(router) == []  # no answer from the tracker yet: nothing piles up
        link.answered(p.Error(p.ErrorCode.UNKNOWN_NODE, "register again"))  # it is back
        link.send(_final("r2"))
        link.answered(p.Ack(detail="billed", request_id="r2"))
        clock.now += 1
        link.answered(p.Ack())  # a heartbeat's answer
        link.check()
        assert [m.request_id for m in _received(router) if isinstance(m, p.Report)] == ["r2"]
        for _ in range(2):
            clock.now += 1
            link.answered(p.Ack())
            link.check()
        assert [m.request_id for m in _received(router)] == ["r1"]  # sent again: the tracker lost it
        link.answered(p.Ack(detail="already recorded: billed", request_id="r1"))
        clock.now += 10
        link.answered(p.Ack())
        link.check()
        assert _received(router) == [] and not link.unacked
    finally:
        link.close()
        router.close(linger=0)


def test_a_report_the_tracker_never_takes_is_given_up(ctx, monkeypatch, caplog):
    """A tracker that answers everything but never acknowledges a report (it refuses it):
    the node sends it a bounded number of times, then gives it up, saying so."""
    monkeypatch.setattr("fabric.net.tracker_link.MAX_RESENDS", 2)
    clock, endpoint = FakeClock(), f"tcp://127.0.0.1:{free_port()}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    link = TrackerLink(ctx, endpoint, None, resend=3.0, clock=clock)
    try:
        link.send(_final("bad"))
        for _ in range(4):
            clock.now += 3
            link.answered(p.Error(p.ErrorCode.BAD_REQUEST, "refused"))
            link.check()
        assert [m.request_id for m in _received(router)] == ["bad"] * 3 and not link.unacked
        assert any("never took the report of request bad" in r.getMessage() for r in caplog.records)
    finally:
        link.close()
        router.close(linger=0)


def test_the_tracker_names_the_report_it_acknowledges(ctx):
    tracker = Tracker(TrackerConfig(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*", db=":memory:",
                                    reach_timeout=0), context=ctx)
    stop = threading.Event()
    thread = threading.Thread(target=tracker.run, args=(stop,), daemon=True)
    thread.start()
    assert tracker.ready.wait(10)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(tracker.endpoint)
    try:
        answers = []
        for _ in range(2):
            dealer.send_multipart(p.encode(_final("r9")))
            assert dealer.poll(5000)
            answers.append(p.decode(dealer.recv_multipart())[0])
        assert [(a.request_id, a.detail) for a in answers] == [("r9", "billed"), ("r9", "already recorded: billed")]
    finally:
        dealer.close(linger=0)
        stop.set()
        thread.join(10)


# --------------------------------------------------------------------------- no empty 500


class CutShort(FakeClient):
    """A client whose ZeroMQ socket was closed under an await: CancelledError, though nobody
    cancelled the request (what made the web UI answer an empty 500)."""

    def generate(self, model, **kwargs):
        async def stream():
            raise asyncio.CancelledError
            yield  # pragma: no cover

        return stream()


@pytest.mark.asyncio
async def test_a_cancelled_fabric_call_is_a_json_error_not_an_empty_500():
    client = create_app(WebUIConfig(), CutShort()).test_client()
    response = await client.post("/v1/chat/completions", json={"model": "smollm2-135m",
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 500
    body = await response.get_json()
    assert body["error"]["code"] == "internal" and "cancelled" in body["error"]["message"]


# --------------------------------------------------------------------------- real processes


def _post(url: str, body: dict) -> tuple[int, str, object]:
    """(status, text of the reply or of its SSE stream, headers); never raises for an HTTP error."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status, headers = r.read().decode(), r.status, r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers
    if not body.get("stream"):
        return status, json.loads(raw)["choices"][0]["message"]["content"], headers
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return status, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")), headers


def _greedy(client: Client, model: str, rid: str) -> tuple[list[int], str]:
    events = list(client.generate(model, messages=MESSAGES, max_tokens=24, request_id=rid))
    assert events[-1].event == "done", events[-1]
    tokens = [e for e in events if e.event == "token"]
    return [t for e in tokens for t in e.token_ids], "".join(e.text for e in tokens)


def test_kill_9_of_the_tracker_costs_new_requests_nothing_and_the_ledger_keeps_each_once(process_cluster,
                                                                                          tiny_models):
    cluster, model = process_cluster, tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 24)
    cluster.split(model)
    url = cluster.start_webui()
    body = {"model": model.name, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    with cluster.client() as client:
        tokens, text = _greedy(client, model.name, "before")  # the client learns the route
        assert tokens == expected
        status, webui_text, headers = _post(url, body)
        assert (status, webui_text) == (200, text)
        ids = ["before", headers["X-Request-Id"]]
        cluster.kill("tracker", signal.SIGKILL)
        for stream in (False, True):
            status, webui_text, headers = _post(url, {**body, "stream": stream})
            assert (status, webui_text) == (200, text), webui_text  # on the routes of the tracker's last plans
            ids.append(headers["X-Request-Id"])
        for rid in ("away-1", "away-2"):
            assert _greedy(client, model.name, rid) == (expected, text)  # on its last route
            ids.append(rid)
        cluster.start_tracker()  # the same port and ledger
        assert _greedy(client, model.name, "restarted") == (expected, text)  # its nodes may not be back yet
        ids.append("restarted")
    cluster.wait_nodes(["a", "b"], model.name, timeout=30)
    ledger = cluster.tmp / "ledger.sqlite3"

    def rows() -> list[tuple[str, str]]:
        with sqlite3.connect(ledger) as db:
            return db.execute("SELECT request_id, status FROM completions ORDER BY request_id").fetchall()
    assert wait_for(lambda: len(rows()) >= len(ids), 20), (rows(), ids)
    assert rows() == sorted((rid, "billed") for rid in ids)
    with cluster.client() as client:
        assert client.status()["usage"]["totals"]["billed"]["requests"] == len(ids)
