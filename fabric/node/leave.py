"""A polite leave: what a node does between SIGTERM and its exit.

It tells the tracker it leaves (plans drop it at once) and stops heartbeating; it refuses
every new session with ``ERROR(leaving)`` (a GENERATE, or a FORWARD at position 0 for a
session it does not hold), so that a client sends the request to another head and a head
routes around it; and it keeps serving the sessions it has until they end, or until the
deadline. A session still running then is handed off by the exit itself: its head sees
the link drop and re-prefills on a replica, as after any failure. No sockets here.
"""
from __future__ import annotations

import logging

from ..wire import protocol as p

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 30.0  # seconds a leaving node gives the sessions it serves to end


class Departure:
    def __init__(self, node_id: str, timeout: float = DRAIN_TIMEOUT):
        self.node_id = node_id
        self.timeout = timeout  # seconds from SIGTERM to the exit, at most
        self.since: float | None = None  # when the leave began (monotonic); None: staying

    @property
    def leaving(self) -> bool:
        return self.since is not None

    def begin(self, now: float, serving: int) -> bool:
        """Start leaving (once): True the first time."""
        if self.since is not None:
            return False
        self.since = now
        log.info("node %s leaving: taking no new session, finishing %d within %.0f s", self.node_id, serving,
                 self.timeout)
        return True

    def refuses(self, msg: p.Forward, holds: bool) -> bool:
        """Whether a leaving node refuses ``msg``: the start of a session it does not hold
        (from position 0, or from another session's kept KV)."""
        return self.since is not None and (msg.pos == 0 or bool(msg.reuse)) and not holds

    def refusal(self, session: str | None = None, step: int | None = None) -> p.Error:
        return p.Error(p.ErrorCode.LEAVING, f"node {self.node_id} is leaving the swarm: use another node",
                       session=session, step=step, node=self.node_id)

    def over(self, now: float, serving: int) -> bool:
        """Whether the node may exit now: every session ended, or the deadline passed."""
        if self.since is None:
            return False
        if serving == 0:
            log.info("node %s: every session ended after %.1f s; leaving", self.node_id, now - self.since)
            return True
        if now - self.since >= self.timeout:
            log.warning("node %s: %d sessions still running after %.0f s; leaving them to their heads' failover",
                        self.node_id, serving, self.timeout)
            return True
        return False
