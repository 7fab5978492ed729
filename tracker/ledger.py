"""The usage ledger: one SQLite row per completed request, keyed by the id its head issued
for it (REPORT's ``ref``: a client cannot choose it, so reusing a request id bills each
request), with the client's request id beside it.

A re-sent report finds its row and bills nothing twice. A request that went on at another
head after its first one died or stopped answering (``resumed`` > 0) is billed once, in
full, at the head that finished it: the cancelled or failed attempt it continued is void,
whichever of the two reports arrives first. The billing guard decides, per
completion, one of:

- ``billed``: counted as usage;
- ``held``: recorded with a reason for review, not counted -- a multi-hop route that
  produced 3 or fewer tokens without being cut by the client's own ``max_tokens``
  looks like a broken route: a hop that runs layers the previous hop already ran
  samples garbage and ends almost at once, often after a single token;
- ``void``: never billed -- the request errored, or was cancelled before its first token.

API keys are stored as ``key_id(api_key)`` (a truncated SHA-256), never in clear text.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fabric.wire import protocol

from .ledger_schema import migrate
from fabric.wire.protocol import Report, check_report

log = logging.getLogger(__name__)

BILLED, HELD, VOID = "billed", "held", "void"
SHORT_OUTPUT_TOKENS = 3  # at or below this, a multi-hop completion is held
CANCELLED = ("cancel", "cancelled")
SCHEMA_VERSION = 2  # 2: rows keyed by the head's attempt id (REPORT.ref), the client's request id beside it

def default_ledger_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_DATA_HOME/meshnet/ledger.sqlite3``, else ``~/.local/share/meshnet/...``."""
    base = environ.get("XDG_DATA_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".local" / "share")
    return Path(base) / "meshnet" / "ledger.sqlite3"


key_id = protocol.key_id  # the stored identity of an API key (clients send only this; the key is never written)


@dataclass(frozen=True)
class BillingVerdict:
    """What the billing guard decided about one final report (an audit's verdict on a node is
    ``fabric.wire.protocol.Verdict``, another thing)."""

    status: str  # billed, held or void
    reason: str  # human-readable why


def billing_verdict(report: Report) -> BillingVerdict:
    """The billing guard for one final report (pure)."""
    tokens, hops = report.completion_tokens, len(report.route)
    if report.finish_reason == "error":
        return BillingVerdict(VOID, "the request ended in an error")
    if report.finish_reason in CANCELLED and tokens == 0:
        return BillingVerdict(VOID, "cancelled before the first token")
    if hops > 1 and tokens <= SHORT_OUTPUT_TOKENS and not _cut_by_client(report):
        return BillingVerdict(HELD, f"suspiciously short: {tokens} output tokens from a {hops}-hop route")
    return BillingVerdict(BILLED, "")


def _cut_by_client(report: Report) -> bool:
    """True when the client's own max_tokens ended the output (finish_reason "length")."""
    if report.finish_reason != "length":
        return False
    return report.max_tokens <= 0 or report.completion_tokens >= report.max_tokens


@dataclass(frozen=True)
class LedgerEntry:
    attempt: str  # the head's id for this attempt at the request (REPORT.ref; the request id from older heads)
    request_id: str  # the client's
    recorded_at: float  # unix time
    model: str
    head_node: str
    api_key_id: str | None
    prompt_tokens: int
    completion_tokens: int
    max_tokens: int
    elapsed: float
    finish_reason: str | None
    route: str  # JSON list of [node, start_layer, end_layer]
    hops: int
    status: str
    reason: str
    resumed: int = 0  # of completion_tokens, those another head streamed before this one took over


_COLUMNS = ", ".join(LedgerEntry.__dataclass_fields__)
_VALUES = ", ".join("?" * len(LedgerEntry.__dataclass_fields__))  # one placeholder per column


def _row(entry: LedgerEntry) -> tuple:
    return tuple(getattr(entry, f) for f in LedgerEntry.__dataclass_fields__)


class Ledger:
    """SQLite-backed usage ledger; use from one thread (the service loop)."""

    def __init__(self, path: Path | str):
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(str(path))
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._db:
            migrate(self._db, SCHEMA_VERSION)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def record(self, report: Report, now: float | None = None) -> tuple[LedgerEntry, bool]:
        """Record a final report once. Returns (entry, True) or (existing entry, False)."""
        check_report(report)
        entry = self._entry(report, time.time() if now is None else now)
        with self._db:
            if self._continued(entry):
                entry = dataclasses.replace(entry, status=VOID, reason="the request went on at another head")
            cur = self._db.execute(
                f"INSERT OR IGNORE INTO completions ({_COLUMNS}) VALUES ({_VALUES})", _row(entry))
            if cur.rowcount == 0:
                log.info("report %s was already recorded; not billed again", entry.attempt)
                return self.get(entry.attempt), False
            if entry.resumed:
                self._void_attempts_before(entry)
            self._db.executemany(
                "INSERT OR IGNORE INTO served VALUES (?, ?, ?, ?)",
                [(entry.attempt, h.node, h.start_layer, h.end_layer) for h in report.route]
                or [(entry.attempt, report.node_id, 0, 0)])
        return entry, True

    @staticmethod
    def _entry(report: Report, now: float) -> LedgerEntry:
        verdict = billing_verdict(report)
        return LedgerEntry(
            attempt=report.billing_id, request_id=report.request_id, recorded_at=now,
            model=report.model, head_node=report.node_id, api_key_id=key_id(report.api_key),
            prompt_tokens=report.prompt_tokens, completion_tokens=report.completion_tokens,
            max_tokens=report.max_tokens, elapsed=report.elapsed, finish_reason=report.finish_reason,
            route=json.dumps([[h.node, h.start_layer, h.end_layer] for h in report.route]),
            hops=len(report.route), status=verdict.status, reason=verdict.reason, resumed=report.resumed)

    _SAME_REQUEST = "request_id = ? AND api_key_id IS ? AND attempt != ?"

    def _continued(self, entry: LedgerEntry) -> bool:
        """``entry`` ended (cancelled, failed) an attempt that another head already continued."""
        if entry.resumed or entry.finish_reason not in (*CANCELLED, "error"):
            return False
        return self._db.execute(
            f"SELECT 1 FROM completions WHERE {self._SAME_REQUEST} AND resumed >= ? AND resumed > 0",
            (entry.request_id, entry.api_key_id, entry.attempt, entry.completion_tokens)).fetchone() is not None

    def _void_attempts_before(self, entry: LedgerEntry) -> None:
        """``entry`` went on after ``resumed`` tokens of an earlier attempt at the same request,
        and bills them all: that attempt's own cancelled or failed report bills nothing."""
        cur = self._db.execute(
            f"UPDATE completions SET status = ?, reason = ? WHERE {self._SAME_REQUEST} "
            "AND finish_reason IN (?, ?, 'error') AND completion_tokens <= ? AND status != ?",
            (VOID, f"the request went on at {entry.head_node}", entry.request_id, entry.api_key_id, entry.attempt,
             *CANCELLED, entry.resumed, VOID))
        if cur.rowcount:
            log.info("request %s went on at %s: its earlier attempt is void", entry.request_id, entry.head_node)

    def get(self, attempt: str) -> LedgerEntry | None:
        """The row of one attempt (a report's ``billing_id``)."""
        row = self._db.execute(f"SELECT {_COLUMNS} FROM completions WHERE attempt = ?", (attempt,)).fetchone()
        return LedgerEntry(*row) if row else None

    def _usage(self, sql: str, status: str) -> dict[str, dict]:
        rows = self._db.execute(sql, (status,)).fetchall()
        return {who: {"requests": n, "prompt_tokens": p, "completion_tokens": c}
                for who, n, p, c in rows}

    def usage_by_key(self, status: str = BILLED) -> dict[str, dict]:
        """Tokens in/out per API key id (``"anonymous"`` for requests without a key)."""
        return self._usage(
            "SELECT COALESCE(api_key_id, 'anonymous'), COUNT(*), SUM(prompt_tokens), "
            "SUM(completion_tokens) FROM completions WHERE status = ? GROUP BY 1 ORDER BY 1",
            status)

    def usage_by_node(self, status: str = BILLED) -> dict[str, dict]:
        """Tokens in/out per serving node (every node on the request's route)."""
        return self._usage(
            "SELECT node_id, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens) FROM "
            "(SELECT DISTINCT s.node_id, c.attempt, c.prompt_tokens, c.completion_tokens "
            " FROM served s JOIN completions c USING (attempt) WHERE c.status = ?) "
            "GROUP BY 1 ORDER BY 1", status)

    def held(self, limit: int = 50) -> list[LedgerEntry]:
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM completions WHERE status = 'held' "
            "ORDER BY recorded_at DESC LIMIT ?", (limit,)).fetchall()
        return [LedgerEntry(*r) for r in rows]

    def totals(self) -> dict[str, dict]:
        """Requests and tokens per status: ``{"billed": {...}, "held": {...}, "void": {...}}``."""
        out = {s: {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
               for s in (BILLED, HELD, VOID)}
        for status, n, p, c in self._db.execute(
                "SELECT status, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens) "
                "FROM completions GROUP BY status"):
            out[status] = {"requests": n, "prompt_tokens": p, "completion_tokens": c}
        return out
