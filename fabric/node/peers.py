"""A node's DEALERs to its peers: one per endpoint, never blocking, each with a link monitor.

Frames to other nodes leave here. Their PONGs and ERRORs come back on the same DEALER,
and its monitor says when the TCP link drops (the peer's process died). From both, the
peers part keeps who is alive (``PeerLiveness``) and the round trip to each
(``RttTable``), which heartbeats carry to the tracker's planner.
"""
from __future__ import annotations

import logging
from collections import Counter

import zmq
import zmq.utils.monitor

from ..net.liveness import PeerLiveness, RttTable
from ..net.security import Security, SecurityError, dial_watched
from ..wire import protocol as p

log = logging.getLogger(__name__)

LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Peers:
    def __init__(self, ctx: zmq.Context, security: Security | None, poller: zmq.Poller, counters: Counter,
                 liveness: PeerLiveness, probe_interval: float):
        self.ctx, self.security, self.poller = ctx, security, poller
        self.counters = counters  # the node's: frames dropped are counted here
        self.liveness = liveness
        self.rtt = RttTable()  # round trips to peers, reported in heartbeats for the planner
        self.probe_interval = probe_interval
        self.probes: dict[str, str] = {}  # endpoint -> key of peers the tracker asked us to measure
        self.socks: dict[str, zmq.Socket] = {}  # endpoint -> the DEALER that dials it
        self.endpoint_of: dict[zmq.Socket, str] = {}  # DEALER or its link monitor -> the peer endpoint
        self.monitors: set[zmq.Socket] = set()
        self._next_probe = 0.0

    def __contains__(self, sock: zmq.Socket) -> bool:
        return sock in self.endpoint_of

    def send(self, endpoint: str, key: str, frames: list, copy: bool = True) -> None:
        """Send without ever blocking the loop: a full or bad peer loses the frame (the
        head's timeout re-sends the step), not the node."""
        try:
            self._sock(endpoint, key).send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self.counters["dropped_frames"] += 1
            log.warning("peer %s is not draining its queue; dropped a frame", endpoint)
        except (zmq.ZMQError, SecurityError) as exc:
            self.counters["dropped_frames"] += 1
            log.warning("cannot send to %r: %s", endpoint, exc)

    def dial(self, endpoint: str, key: str) -> None:
        """Open the link to ``endpoint`` now (its monitor says when the peer dies), if none is."""
        try:
            self._sock(endpoint, key)
        except (zmq.ZMQError, SecurityError) as exc:
            log.warning("cannot dial %r: %s", endpoint, exc)

    def _sock(self, endpoint: str, key: str) -> zmq.Socket:
        sock = self.socks.get(endpoint)
        if sock is None:
            # a monitor of its link: the link going down = the peer died
            sock, monitor = dial_watched(self.ctx, endpoint, self.security, key, LINK_EVENTS)
            self.socks[endpoint] = sock
            for s in (sock, monitor):  # pongs and errors come back on the DEALER
                self.endpoint_of[s] = endpoint
                self.poller.register(s, zmq.POLLIN)
            self.monitors.add(monitor)
        return sock

    def ping(self, endpoint: str, key: str, now: float) -> None:
        self.send(endpoint, key, p.encode(p.Ping(self.rtt.ping(endpoint, now))))

    def received(self, sock: zmq.Socket, frames: list) -> p.Error | None:
        """Frames read on one of our sockets: a link event, a PONG (the peer lives), or an
        ERROR about a session, which is returned for the head."""
        endpoint = self.endpoint_of[sock]
        if sock in self.monitors:
            event = zmq.utils.monitor.parse_monitor_message([f.bytes for f in frames])["event"]
            self.liveness.link(endpoint, up=event != zmq.EVENT_DISCONNECTED)
            if event == zmq.EVENT_DISCONNECTED:
                self.rtt.relinked(endpoint)  # the PING after a reconnect waits for a handshake
            return None
        try:
            msg, _ = p.decode(frames)
        except p.ProtocolError as exc:
            log.warning("bad frame from peer %s: %s", endpoint, exc)
            return None
        self.liveness.seen(endpoint)
        if isinstance(msg, p.Pong):
            self.rtt.pong(endpoint, msg.nonce, msg.node)
        return msg if isinstance(msg, p.Error) and msg.session else None

    def watch(self, keys: dict[str, str], now: float) -> set[str]:
        """Ping the peers at ``keys`` (endpoint -> key) when due; return those that died."""
        watched = set(keys)
        for endpoint in self.liveness.watch(watched, now):
            self.ping(endpoint, keys[endpoint], now)
        dead = self.liveness.dead(watched, now)
        self.liveness.forget(watched)
        return dead

    def probe(self, now: float) -> None:
        """PING the peers we send to and those the tracker named, to time the round trip."""
        if now < self._next_probe:
            return
        self._next_probe = now + self.probe_interval
        for endpoint, key in {**dict.fromkeys(self.socks, ""), **self.probes}.items():
            self.ping(endpoint, key, now)

    def close(self) -> None:
        for sock in self.socks.values():
            # first stop each link monitor: an event for a monitor whose reader is gone blocks
            # the context's I/O thread, and with it every socket of this process
            sock.disable_monitor()
        for sock in self.endpoint_of:
            sock.close(linger=0)
        self.socks.clear()
        self.endpoint_of.clear()
        self.monitors.clear()
