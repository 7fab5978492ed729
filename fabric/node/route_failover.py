"""A request's failover at its head: hops that stopped answering are routed around.

A mixin of RouteSession (fabric/node/route_session.py), apart because it is one job: when
hops of a request's route die, the head stops waiting on them (``begin_failover``), asks the
tracker for a route that avoids them, and continues on it (``reroute``: the history
re-prefilled, never a rejected draft), or stays where none does (``keep_route``, with a
back-off), asking again around fewer nodes (``widen``). It reads and writes the session's
route, its excluded and lost nodes and its timers; it sends through the session's ``_send``
and ``_tell_route``.
"""
from __future__ import annotations

import logging
import time

from ..wire.protocol import Cancel, Event, Hop

log = logging.getLogger(__name__)


class Failover:
    """Routing a RouteSession around hops that died."""

    def begin_failover(self, dead_nodes: set[str]) -> None:
        """Hops died: stop waiting on them until ``reroute`` gives a route around them."""
        self.excluded |= dead_nodes
        self.lost = set(dead_nodes)
        self.awaiting_route = True
        self.sent_at = time.monotonic()
        log.warning("session %s: hop(s) %s stopped answering; re-planning around them",
                    self.session, ", ".join(sorted(dead_nodes)))

    def keep_route(self, lost: set[str], now: float) -> None:
        """No route avoids the lost hops: stay on this one (they may be restarting) and let
        the step timeout re-send; ask again only after a back-off."""
        self.excluded -= lost
        self.awaiting_route = False
        self.sent_at = now
        self.replan_backoff = min(self.replan_backoff * 2, 30.0)
        self.replan_after = now + self.replan_backoff
        log.warning("session %s: no route avoids %s; waiting for it to come back", self.session,
                    ", ".join(sorted(lost)))

    def widen(self) -> bool:
        """No route avoids the excluded nodes: exclude fewer, and ask again. Nodes lost earlier
        in this request may be back (restarted under their names), and so may the ones lost
        now, at another endpoint (``reroute`` refuses their dead ones). False when nothing is
        excluded any more."""
        if self.excluded - self.lost:
            self.excluded = set(self.lost)
        elif self.excluded:
            self.excluded = set()
        else:
            return False
        return True

    def reroute(self, route: tuple[Hop, ...]) -> list[Event]:
        """Continue on ``route`` (same head): free the old hops, re-prefill the history."""
        if self.finished:
            return []
        dead = {h.endpoint for h in self.route if h.node in self.lost}
        same_head = route[0].endpoint == self.route[0].endpoint and route[0].start_layer == 0
        if not same_head or any(h.node in self.excluded or h.endpoint in dead for h in route):
            # a route back through a lost hop's dead endpoint (the tracker still lists it), or
            # not this session's answer (one lost with a tracker put answers out of step):
            # stay, and ask again after the back-off
            self.keep_route(self.lost, time.monotonic())
            return []
        self._tell_route(Cancel)  # live hops of the old route free their KV; dead ones never hear
        self.route, self.awaiting_route = route, False
        self.failovers += 1
        self.retries = 0
        self._send(self.history, pos=0)
        return []
