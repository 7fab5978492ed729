"""Peer liveness for the head's active routes.

Two signals, so that a hop busy with a long computation is never taken for dead:
- the TCP link: a peer process that dies closes its sockets, and the head's DEALER to it
  reports the disconnect at once (a ZeroMQ socket monitor). A link down for ``grace``
  seconds means the peer is gone;
- silence (Paranoid Pirate style): the head pings each hop every ``interval``; a hop that
  answers nothing for ``silence`` seconds (hung machine, lost network) is dead too.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .protocol import Hop


@dataclass
class PeerLiveness:
    interval: float = 0.25  # seconds between pings to a watched peer
    silence: float = 10.0  # a peer that answers nothing this long is dead
    grace: float = 0.25  # a peer whose link stays down this long is dead
    _last_seen: dict[str, float] = field(default_factory=dict)
    _last_ping: dict[str, float] = field(default_factory=dict)
    _down_since: dict[str, float] = field(default_factory=dict)

    def watch(self, endpoints, now: float | None = None) -> list[str]:
        """Endpoints to ping now, among ``endpoints`` (starting to watch new ones)."""
        now = time.monotonic() if now is None else now
        due = []
        for e in endpoints:
            self._last_seen.setdefault(e, now)  # a newly watched peer gets a full timeout
            if now - self._last_ping.get(e, float("-inf")) >= self.interval:
                self._last_ping[e] = now
                due.append(e)
        return due

    def seen(self, endpoint: str, now: float | None = None) -> None:
        self._last_seen[endpoint] = time.monotonic() if now is None else now

    def link(self, endpoint: str, up: bool, now: float | None = None) -> None:
        """The TCP link to ``endpoint`` came up (handshake done) or went down."""
        if up:
            self._down_since.pop(endpoint, None)
        else:
            self._down_since.setdefault(endpoint, time.monotonic() if now is None else now)

    def dead(self, endpoints, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {e for e in endpoints
                if now - self._down_since.get(e, now) > self.grace
                or now - self._last_seen.get(e, now) > self.silence}

    def forget(self, keep) -> None:
        """Stop watching peers not in ``keep`` (no active route uses them)."""
        keep = set(keep)
        for d in (self._last_seen, self._last_ping):
            for e in [e for e in d if e not in keep]:
                del d[e]


def splice(head: Hop, plan: tuple[Hop, ...]) -> tuple[Hop, ...]:
    """A route that keeps ``head`` (this node, layers 0..e) and continues along ``plan``
    from layer e+1. ``plan`` covers every layer contiguously, so some hop holds e+1."""
    route = [head]
    for hop in plan:
        if hop.end_layer <= head.end_layer:
            continue
        start = max(hop.start_layer, route[-1].end_layer + 1)
        route.append(Hop(hop.node, hop.endpoint, start, hop.end_layer, key=hop.key))
    return tuple(route)
