"""The tracker's rows of fetches from peers (tracker/fetches.py), on a numeric clock: what
STATUS shows of them, the events they make, and the bounds on what a member may report."""
from __future__ import annotations

import pytest

from fabric.wire import protocol as p
from tracker import fetches as f
from tracker.events import EventRing


def report(fetch: str = "f1", done: int = 10, bad: tuple[str, ...] = (), **kw) -> p.FetchReport:
    return p.FetchReport(fetch, "tiny", 3, 5, done, 100, rate=5, bad_peers=bad, node="b", **kw)


@pytest.fixture
def board():
    clock = [0.0]
    published: list[dict] = []
    fetches = f.Fetches(EventRing(), published.append, clock=lambda: clock[0])
    return fetches, clock, published


def test_a_fetch_is_one_row_its_bad_peers_are_named_once_and_its_end_is_an_event(board):
    fetches, clock, published = board
    fetches.report(report(), "key-b")
    fetches.report(report(done=40, bad=("c",)), "key-b")
    fetches.report(report(done=70, bad=("c",)), "key-b")  # named again: no second event
    (row,) = fetches.view()
    assert (row["done"], row["total"], row["bad_peers"], row["state"]) == (70, 100, ["c"], "fetching")
    assert fetches.named() == {"c": 1}
    fetches.report(report(done=100, bad=("c",), final=True), "key-b")
    assert fetches.view()[0]["state"] == "done"
    assert [(e["kind"], e["code"], e["node"]) for e in published] == [("fetch", "bad_bytes", "c"),
                                                                       ("fetch", "fetched", "b")]
    assert fetches.report(report(done=50), "key-b").detail == "ended"  # a late report changes nothing
    assert fetches.view()[0]["done"] == 100


def test_another_sender_cannot_touch_a_fetch_it_did_not_start(board):
    fetches, _, published = board
    fetches.report(report(), "key-b")
    with pytest.raises(p.ProtocolError, match="another peer"):
        fetches.report(report(done=99, bad=("honest",)), "key-x")
    assert fetches.view()[0]["done"] == 10 and fetches.named() == {} and published == []


def test_rows_are_bounded_and_expire(board):
    fetches, clock, _ = board
    for i in range(f.MAX_FETCHES + 5):
        fetches.report(report(fetch=f"f{i}"), f"key-{i}")
    rows = fetches.view()
    assert len(rows) == f.MAX_FETCHES and rows[0]["fetch"] == "f5"  # the least recently reported went first
    fetches.report(report(fetch="f9", final=True, error="no peer left"), "key-9")
    clock[0] = f.FETCH_TTL + 1
    assert [r["fetch"] for r in fetches.view()] == ["f9"] and fetches.view()[0]["state"] == "failed"
    clock[0] = f.FETCH_TTL + f.ENDED_TTL + 2
    assert fetches.view() == []


def test_a_report_is_bounded_on_the_wire():
    with pytest.raises(p.ProtocolError, match="bad_peers"):
        p.decode(p.encode(report(bad=tuple(f"n{i}" for i in range(p.MAX_BAD_PEERS + 1)))))
    with pytest.raises(p.ProtocolError, match="done"):
        p.decode(p.encode(p.FetchReport("f", "tiny", 0, 1, 101, 100)))
