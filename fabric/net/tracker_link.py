"""A node's link to the tracker: one DEALER, and plain words when the tracker is not there.

The link sends REGISTER, HEARTBEAT, REPORT and ROUTE_REQUEST without blocking, and says in
the log, once and with the fix, what a newcomer would otherwise never see:

- the tracker does not answer (a wrong ``--tracker``, a tracker not started yet): a WARNING
  naming the address after ``silence`` seconds, repeated every ``repeat`` seconds while it
  lasts, and a line when it answers at last. Messages queue meanwhile and flow once it is up;
- the CurveZMQ handshake fails: the tracker requires keys this node lacks, or uses none
  while this node has some, or refuses this node's key, or its key is not the one in
  ``DIR/allowed/tracker.key``;
- the tracker refuses a message (an ERROR reply): the reason, once per distinct reason.

The usage of a request is never lost to a tracker that is away or restarts: a final REPORT
is kept until an ACK names its request id, and sent again while the tracker answers other
messages but not that one (it died with the report in a buffer). The ledger bills a
request id once, so a report sent twice costs nothing.

It never decides anything else for the node; the node reads the replies it passes on.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

import zmq
import zmq.utils.monitor

from ..wire import protocol as p
from ..wire.liveness import TRACKER_SILENCE
from .security import Security, dial_watched

log = logging.getLogger("fabric.node")

SILENCE_S = TRACKER_SILENCE  # a tracker that answers nothing this long after a message gets a WARNING
REPEAT_S = 60.0  # ...repeated this often while the silence lasts
RESEND_S = 3.0  # a final report not acknowledged this long, while the tracker answers, is sent again
MAX_UNACKED = 10_000  # final reports kept for the tracker; beyond that the oldest is given up (logged)
MAX_RESENDS = 20  # a report the tracker answers but never acknowledges (it refuses it) is given up after this
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class TrackerLink:
    def __init__(self, ctx: zmq.Context, endpoint: str, security: Security | None,
                 silence: float = SILENCE_S, repeat: float = REPEAT_S, resend: float = RESEND_S,
                 clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint
        self.security = security
        self.silence, self.repeat, self.resend, self._clock = silence, repeat, resend, clock
        self.sock, self.monitor = dial_watched(ctx, endpoint, security, security and security.tracker_key,
                                               HANDSHAKE_EVENTS)
        self._waiting_since: float | None = None  # first message sent since the last reply
        self._warned_at: float | None = None  # last "does not answer" warning
        self._said: set[str] = set()  # handshake problems and refusals already logged
        self._answered_at: float | None = None  # the tracker's last reply of any kind
        self._back_at = 0.0  # its first reply after a silence longer than ``resend``
        # request id -> [final report, when it was last sent, times sent again]: usage not acknowledged yet
        self.unacked: OrderedDict[str, list] = OrderedDict()

    # -- sending and replies --------------------------------------------------------------

    def send(self, message: p.Message) -> bool:
        """Queue ``message`` for the tracker; False (logged once) when it cannot take more.
        A final report is also kept until the tracker acknowledges it."""
        if isinstance(message, p.Report) and message.final:
            self._keep(message)
        if self._waiting_since is None:
            self._waiting_since = self._clock()
        try:
            self.sock.send_multipart(p.encode(message), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            self._once("dropped", logging.DEBUG if self._warned_at else logging.WARNING,
                       "the tracker at %s is not reading; dropping messages to it until it is", self.endpoint)
            return False

    def answered(self, message: p.Message) -> None:
        """A reply came: the tracker is there. Refusals are logged, once per reason."""
        if self._warned_at is not None:
            log.info("the tracker at %s answers now", self.endpoint)
        self._waiting_since = self._warned_at = None
        now = self._clock()
        if self._answered_at is None or now - self._answered_at > self.resend:
            self._back_at = now  # what was queued meanwhile flows now: give it time to be acknowledged
        self._answered_at = now
        if isinstance(message, p.Ack) and message.request_id:
            self.unacked.pop(message.request_id, None)
        self._said.discard("dropped")
        if isinstance(message, p.Error) and message.code not in {p.ErrorCode.UNKNOWN_NODE, *p.NO_ROUTE_CODES}:
            self._once(f"refused:{message.code}:{message.message}", logging.WARNING,
                       "the tracker at %s refused this node: %s (%s)", self.endpoint, message.message, message.code)

    def check(self, now: float | None = None) -> None:
        """Warn about a tracker that has not answered for ``silence`` seconds (call often)."""
        now = self._clock() if now is None else now
        self._resend(now)
        if self._waiting_since is None or now - self._waiting_since < self.silence:
            return
        if self._warned_at is None or now - self._warned_at >= self.repeat:
            self._warned_at = now
            log.warning("the tracker at %s does not answer (%.0f s so far): is it running, and is --tracker "
                        "right? This node keeps trying; until it answers, no new client can find this node",
                        self.endpoint, now - self._waiting_since)

    # -- usage the tracker has not taken ---------------------------------------------------

    def _keep(self, report: p.Report) -> None:
        self.unacked[report.billing_id] = [report, self._clock(), 0]
        self.unacked.move_to_end(report.billing_id)
        if len(self.unacked) > MAX_UNACKED:
            lost, _ = self.unacked.popitem(last=False)
            log.warning("the tracker at %s has not taken %d reports: giving up the usage of request %s",
                        self.endpoint, MAX_UNACKED, lost)

    def _resend(self, now: float) -> None:
        """Send again the final reports the tracker left unacknowledged though it answers: they
        died with it. While it is away they wait in the socket's queue, which flows once it is back."""
        if self._answered_at is None or now - self._answered_at > self.resend:
            return
        for rid, entry in list(self.unacked.items()):
            if now - max(entry[1], self._back_at) < self.resend:
                continue
            if entry[2] >= MAX_RESENDS:
                del self.unacked[rid]
                log.warning("the tracker at %s answers but never took the report of request %s: giving it up",
                            self.endpoint, rid)
                continue
            entry[1], entry[2] = now, entry[2] + 1
            self._send_now(entry[0])

    def _send_now(self, message: p.Message) -> None:
        try:
            self.sock.send_multipart(p.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # kept: sent again later

    # -- the handshake ---------------------------------------------------------------------

    def on_monitor(self, frames: list) -> None:
        """One event of the socket monitor: a failed handshake says why, once."""
        event = zmq.utils.monitor.parse_monitor_message([bytes(f) for f in frames])
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._said = {s for s in self._said if not s.startswith("handshake")}
            return
        self._once(f"handshake:{kind}:{value}", logging.ERROR, "%s", self.handshake_problem(kind, value))

    def handshake_problem(self, kind: int, value: int) -> str:
        """What a failed handshake with the tracker means, and what to do."""
        where = f"the tracker at {self.endpoint}"
        keys = self.security.directory if self.security else None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if keys is None:
                return f"{where} requires CurveZMQ keys (start with --keys DIR; see `meshnet keys --help`)"
            return f"{where} does not use CurveZMQ keys but this node does (--keys {keys}): start both with keys, or neither"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"{where} refused this node's key: copy {keys}/id.key into the tracker's allowed/ folder "
                    f"(as allowed/NAME.key) and start again")
        if keys is not None:
            return (f"the CurveZMQ handshake with {where} failed: is {keys}/allowed/tracker.key a copy of the "
                    f"tracker's id.key?")
        return f"the handshake with {where} failed (event {kind:#x}, {value:#x}): is that address a meshnet tracker?"

    def _once(self, key: str, level: int, fmt: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, fmt, *args)

    def close(self) -> None:
        self.sock.disable_monitor()  # first: an event for a monitor nobody reads blocks the context
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
