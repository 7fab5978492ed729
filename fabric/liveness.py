"""Peer liveness for the head's active routes (Paranoid Pirate style): ping every hop a
request depends on at a short interval; a hop silent for ``timeout`` is dead."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PeerLiveness:
    interval: float = 0.25  # seconds between pings to a watched peer
    timeout: float = 1.0  # a peer silent this long is dead
    _last_seen: dict[str, float] = field(default_factory=dict)
    _last_ping: dict[str, float] = field(default_factory=dict)

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

    def dead(self, endpoints, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {e for e in endpoints if now - self._last_seen.get(e, now) > self.timeout}

    def forget(self, keep) -> None:
        """Stop watching peers not in ``keep`` (no active route uses them)."""
        keep = set(keep)
        for d in (self._last_seen, self._last_ping):
            for e in [e for e in d if e not in keep]:
                del d[e]


def splice(head: "Hop", plan: tuple) -> tuple:
    """A route that keeps ``head`` (this node, layers 0..e) and continues along ``plan``
    from layer e+1. ``plan`` covers every layer contiguously, so some hop holds e+1."""
    from .protocol import Hop

    route = [head]
    for hop in plan:
        if hop.end_layer <= head.end_layer:
            continue
        start = max(hop.start_layer, route[-1].end_layer + 1)
        route.append(Hop(hop.node, hop.endpoint, start, hop.end_layer))
    return tuple(route)
