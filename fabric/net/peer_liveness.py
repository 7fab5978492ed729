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
from collections import deque
from dataclasses import dataclass, field, replace

from ..wire.protocol import MAX_RTT_MS, MAX_RTT_PEERS, Hop


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

    @property
    def any_down(self) -> bool:
        """Whether the link to some peer is down now."""
        return bool(self._down_since)

    def down(self, endpoints, now: float | None = None) -> set[str]:
        """Those of ``endpoints`` whose link went down and stayed down past the grace (their
        process closed its sockets or died), silence aside."""
        now = time.monotonic() if now is None else now
        return {e for e in endpoints if now - self._down_since.get(e, now) > self.grace}

    def forget(self, keep) -> None:
        """Stop watching peers not in ``keep`` (no active route uses them)."""
        keep = set(keep)
        for d in (self._last_seen, self._last_ping):
            for e in [e for e in d if e not in keep]:
                del d[e]

    def drop(self, endpoint: str) -> None:
        """Forget all about ``endpoint``: this node closed its link there."""
        for d in (self._last_seen, self._last_ping, self._down_since):
            d.pop(endpoint, None)


@dataclass
class RttTable:
    """Round-trip times to peers, measured PING -> PONG, smoothed per peer node id.

    One PING per endpoint is outstanding at a time: a newer PING replaces it, so a PONG
    that comes back after the next PING was sent (the peer was computing) is no sample.
    The first PONG on a fresh link is no sample either: its PING waited for the TCP and
    ZeroMQ handshakes. A peer answers PINGs between hops, so a sample can still include
    part of a hop's compute; each sample is first capped at twice the least of the peer's
    recent samples, then folded into an exponentially weighted moving average.

    Node ids are what peers say in their PONGs: at most ``max_nodes`` are kept, the ones
    sampled longest ago go first. Endpoints are forgotten with their link (``drop``).
    """

    alpha: float = 0.2  # weight of a new sample in the moving average
    max_age: float = 60.0  # a peer with no sample for this long is forgotten
    window: int = 16  # recent samples whose least bounds a new one
    max_nodes: int = 2 * MAX_RTT_PEERS  # peer node ids kept (a heartbeat reports MAX_RTT_PEERS)
    _sent: dict[str, tuple[int, float]] = field(default_factory=dict)  # endpoint -> (nonce, when)
    _ms: dict[str, float] = field(default_factory=dict)  # peer node id -> smoothed ms
    _recent: dict[str, deque] = field(default_factory=dict)  # peer node id -> raw samples
    _updated: dict[str, float] = field(default_factory=dict)  # peer node id -> last sample time
    _linked: set[str] = field(default_factory=set)  # endpoints whose link has answered once
    _nonce: int = 0

    def ping(self, endpoint: str, now: float | None = None) -> int:
        """The nonce for a PING to ``endpoint`` sent now."""
        self._nonce = self._nonce % (1 << 62) + 1
        self._sent[endpoint] = (self._nonce, time.monotonic() if now is None else now)
        return self._nonce

    def pong(self, endpoint: str, nonce: int, node: str, now: float | None = None) -> float | None:
        """Account a PONG from ``endpoint``; returns the raw sample in ms, or None."""
        sent = self._sent.get(endpoint)
        if not node or sent is None or sent[0] != nonce:
            return None
        del self._sent[endpoint]
        if endpoint not in self._linked:  # the handshake's round trips are in this one
            self._linked.add(endpoint)
            return None
        now = time.monotonic() if now is None else now
        sample = min((now - sent[1]) * 1000.0, MAX_RTT_MS)
        if node not in self._ms and len(self._ms) >= self.max_nodes:
            self._forget_node(min(self._updated, key=self._updated.__getitem__))
        recent = self._recent.setdefault(node, deque(maxlen=self.window))
        recent.append(sample)
        bounded = min(sample, 2.0 * min(recent))
        old = self._ms.get(node)
        self._ms[node] = bounded if old is None else (1 - self.alpha) * old + self.alpha * bounded
        self._updated[node] = now
        return sample

    def relinked(self, endpoint: str) -> None:
        """The link to ``endpoint`` was (re)established: its next PONG is no sample."""
        self._linked.discard(endpoint)

    def drop(self, endpoint: str) -> None:
        """Forget the PING outstanding to ``endpoint`` and its link: this node closed it."""
        self._sent.pop(endpoint, None)
        self._linked.discard(endpoint)

    def _forget_node(self, node: str) -> None:
        for d in (self._ms, self._recent, self._updated):
            d.pop(node, None)

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        """Smoothed ms per peer node id (at most MAX_RTT_PEERS, freshest first)."""
        now = time.monotonic() if now is None else now
        for node in [n for n, t in self._updated.items() if now - t > self.max_age]:
            self._forget_node(node)
        fresh = sorted(self._ms, key=lambda n: -self._updated[n])[:MAX_RTT_PEERS]
        return {n: round(self._ms[n], 3) for n in fresh}


def splice(head: Hop, plan: tuple[Hop, ...]) -> tuple[Hop, ...]:
    """A route that keeps ``head`` (this node, layers 0..e) and continues along ``plan``
    from layer e+1. ``plan`` covers every layer contiguously, so some hop holds e+1. Where
    the plan gives this node itself more layers (its first hop ran only part of its shard,
    beside another node now gone), the head's hop takes them: a node is on a route once,
    since it keeps one KV per session."""
    own = [h.end_layer for h in plan if h.node == head.node]
    head = replace(head, end_layer=max([head.end_layer, *own]))
    route = [head]
    for hop in plan:
        if hop.end_layer <= head.end_layer:
            continue
        start = max(hop.start_layer, route[-1].end_layer + 1)
        route.append(Hop(hop.node, hop.endpoint, start, hop.end_layer, key=hop.key))
    return tuple(route)
