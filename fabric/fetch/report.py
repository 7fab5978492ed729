"""A fetch tells the tracker how it goes (FETCH_REPORT): bytes done of total, its rate, and the
peers it caught sending bad bytes, so that `meshnet status` and the dashboard show machines
that are fetching and name those peers (``tracker/fetches.py``).

Reports are a courtesy, never a condition: one goes every REPORT_EVERY seconds, at once when
a bad peer is caught, and at the end. A thread of the reporter's own sends them, so the fetch
never waits for the tracker (which is never in the data path): a report not sent yet gives
way to a newer one, which says as much and more (bad peers are named in every report after
the first that names them). A tracker that does not answer within REPORT_WAIT (or an older
one that does not know the kind) gets no more reports from this fetch; the fetch goes on.
The thread outlives the fetch until the last report is answered (REPORT_WAIT at most), so
a process that ends after a fetch (``meshnet pull``) waits that long for it.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque

from ..client import Client, FabricError
from ..net.security import Security
from ..wire import protocol as p
from ..wire.shard import Shard

log = logging.getLogger(__name__)

REPORT_EVERY = 1.0  # seconds between progress reports
REPORT_WAIT = 2.0  # seconds to wait for the tracker's ACK before reporting no more
RATE_WINDOW = 5.0  # seconds of progress the reported rate is taken over


class FetchReporter:
    """The reports of one fetch, sent by a thread of its own over a client of its own to the tracker."""

    def __init__(self, tracker: str, security: Security | None, model: str, node: str = ""):
        self.tracker, self.security, self.model, self.node = tracker, security, model, node
        self.fetch = secrets.token_hex(8)
        self.silent = False  # the tracker did not take a report: no more (set by the thread)
        self.due: p.FetchReport | None = None  # the newest report the thread has not sent yet
        self.ended = False  # the last report is made: the thread stops once it is sent
        self.wake = threading.Condition()
        self.thread: threading.Thread | None = None  # started by the first report
        self.shard: Shard | None = None
        self.total = 0
        self.sent_at = 0.0
        self.sent_bad = 0
        self.samples: deque[tuple[float, int]] = deque()  # (when, bytes done), over RATE_WINDOW

    def begin(self, shard: Shard, total: int, done: int) -> None:
        self.shard, self.total = shard, total
        self.progress(done, [], force=True)

    def progress(self, done: int, bad: list[str], force: bool = False) -> None:
        """Report ``done`` bytes and the ``bad`` peers when due (now, if a bad peer is new)."""
        now = time.monotonic()
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW:
            self.samples.popleft()
        if force or len(bad) > self.sent_bad or now - self.sent_at >= REPORT_EVERY:
            self._send(done, bad, now)

    def end(self, done: int, bad: list[str], error: str = "") -> None:
        """The last report; the thread sends it after the fetch has returned."""
        self._send(done, bad, time.monotonic(), final=True, error=error[:1024])
        with self.wake:
            self.ended = True
            self.wake.notify()

    def _rate(self) -> int:
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return int((d1 - d0) / (t1 - t0)) if t1 > t0 else 0

    def _send(self, done: int, bad: list[str], now: float, final: bool = False, error: str = "") -> None:
        if self.silent or self.shard is None:
            return
        self.sent_at, self.sent_bad = now, len(bad)
        report = p.FetchReport(self.fetch, self.model, self.shard.start, self.shard.end, min(done, self.total),
                               self.total, rate=max(0, self._rate()), bad_peers=tuple(bad[:p.MAX_BAD_PEERS]),
                               node=self.node, final=final, error=error)
        with self.wake:
            self.due = report  # one not sent yet is replaced: this one says as much and more
            self.wake.notify()
        if self.thread is None:  # not a daemon: a process ending after the fetch waits for the last report
            self.thread = threading.Thread(target=self._run, name="fetch-report")
            self.thread.start()

    def _next(self) -> p.FetchReport | None:
        """The next report to send; None once the last one is sent."""
        with self.wake:
            while self.due is None and not self.ended:
                self.wake.wait()
            report, self.due = self.due, None
            return report

    def _run(self) -> None:
        with Client(self.tracker, timeout=REPORT_WAIT, security=self.security) as client:
            while (report := self._next()) is not None:
                try:
                    answer = client.ask(report)
                except (FabricError, p.ProtocolError) as exc:
                    answer = exc
                if not isinstance(answer, p.Ack):
                    self.silent = True
                    log.info("the tracker took no report of this fetch (%s): it goes on without reporting", answer)
                    return
