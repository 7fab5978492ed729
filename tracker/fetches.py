"""Fetches of weights from peers, as their fetchers report them (FETCH_REPORT): what STATUS and
the dashboard show of machines that are fetching layers, and of the peers those caught sending
bad bytes.

A report comes from anyone the tracker admits (in a secured swarm, a key of the swarm), so
nothing here acts on it: it is shown, and a peer it names is marked as named, never left out
of plans (an audit does that, tracker/audits.py). Each fetch is one row, keyed by the id its
fetcher chose and owned by whoever sent its first report (the CURVE key, else the
connection): another sender cannot touch it. At most MAX_FETCHES rows, the least recently
reported dropped first; a row whose fetch stopped reporting goes after FETCH_TTL, one that
ended after ENDED_TTL. Each peer a fetch names for the first time is a ``fetch`` event
(``code: "bad_bytes"``), and so is the end of a fetch (``fetched`` or ``fetch_failed``).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from fabric.wire.protocol import MAX_BAD_PEERS, Ack, ErrorCode, FetchReport, ProtocolError

from .events import EventRing

MAX_FETCHES = 64  # rows kept; past that the least recently reported goes
FETCH_TTL = 30.0  # seconds a fetch that stopped reporting stays listed (its fetcher reports every second)
ENDED_TTL = 120.0  # seconds a fetch that ended stays listed


@dataclass
class FetchRow:
    owner: str
    report: FetchReport
    updated: float
    bad: list[str] = field(default_factory=list)  # every peer its reports named, first seen first


class Fetches:
    def __init__(self, events: EventRing, emit: Callable[[dict], None], clock: Callable[[], float] = time.monotonic):
        self.events, self.emit, self.clock = events, emit, clock
        self.rows: OrderedDict[str, FetchRow] = OrderedDict()

    def report(self, msg: FetchReport, owner: str) -> Ack:
        now = self.clock()
        self.expire(now)
        row = self.rows.get(msg.fetch)
        if row is None:
            row = self.rows[msg.fetch] = FetchRow(owner, msg, now)
            while len(self.rows) > MAX_FETCHES:
                self.rows.popitem(last=False)
        elif row.owner != owner:
            raise ProtocolError(f"fetch {msg.fetch!r} is reported by another peer", ErrorCode.BAD_REQUEST)
        elif row.report.final:
            return Ack(detail="ended")  # a late report of an ended fetch changes nothing
        self.rows.move_to_end(msg.fetch)
        row.report, row.updated = msg, now
        for peer in msg.bad_peers:
            if peer not in row.bad and len(row.bad) < MAX_BAD_PEERS:
                row.bad.append(peer)
                self._event(msg, f"{peer} sent bytes of {msg.model} that do not match its manifest "
                                 f"({_who(msg)}); left out, the fetch goes on from other peers",
                            "bad_bytes", node=peer)
        if msg.final:
            self._ended(msg)
        return Ack(detail="reported")

    def _ended(self, msg: FetchReport) -> None:
        if msg.error:
            self._event(msg, f"{_who(msg)} failed: {msg.error}", "fetch_failed", node=msg.node)
        else:
            self._event(msg, f"{_who(msg)} finished: {msg.total / (1 << 20):,.1f} MiB verified", "fetched",
                        node=msg.node)

    def _event(self, msg: FetchReport, text: str, code: str, node: str) -> None:
        self.emit(self.events.add("fetch", text, node=node, model=msg.model, code=code, fetch=msg.fetch,
                                  layers=[msg.start_layer, msg.end_layer]))

    def expire(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        for key, row in list(self.rows.items()):
            if now - row.updated > (ENDED_TTL if row.report.final else FETCH_TTL):
                del self.rows[key]

    def view(self) -> list[dict]:
        """The rows STATUS shows (``fetches``), oldest report first."""
        self.expire()
        now = self.clock()
        return [_row(r, now) for r in self.rows.values()]

    def named(self) -> dict[str, int]:
        """node id -> how many listed fetches caught it sending bad bytes."""
        counts: dict[str, int] = {}
        for row in self.rows.values():
            for peer in row.bad:
                counts[peer] = counts.get(peer, 0) + 1
        return counts


def _who(msg: FetchReport) -> str:
    by = f"node {msg.node}'s" if msg.node else "a"
    return f"{by} fetch of layers {msg.start_layer}-{msg.end_layer} of {msg.model}"


def _row(row: FetchRow, now: float) -> dict:
    r = row.report
    state = ("failed" if r.error else "done") if r.final else "fetching"
    return {"fetch": r.fetch, "node": r.node, "model": r.model, "layers": [r.start_layer, r.end_layer],
            "done": r.done, "total": r.total, "rate": r.rate, "bad_peers": list(row.bad), "state": state,
            "error": r.error, "last_report_s": round(now - row.updated, 3)}
