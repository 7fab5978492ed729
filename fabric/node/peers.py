"""A node's DEALERs to its peers: one per endpoint, never blocking, each with a link monitor.

Frames to other nodes leave here. Their PONGs and ERRORs come back on the same DEALER,
and its monitor says when the TCP link drops (the peer's process died). From both, the
peers part keeps who is alive (``PeerLiveness``) and the round trip to each
(``RttTable``), which heartbeats carry to the tracker's planner.

Endpoints come from what peers name (a FORWARD's ``reply_to`` and route), so the links are
bounded: at most MAX_PEERS are open; one that nothing was sent through for PEER_IDLE_S
and that no route, probe or session here needs is closed (``prune``); and a new one past
the bound takes the place of the least recently used that none needs, or is refused (the
frame dropped and counted), never the node's file descriptors.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable

import zmq
import zmq.utils.monitor

from ..net.peer_liveness import PeerLiveness, RttTable
from ..net.security import Security, SecurityError, dial_watched
from ..wire import protocol as p

log = logging.getLogger(__name__)

LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
MAX_PEERS = 128  # links open at once (a DEALER and its monitor: three ZeroMQ sockets, about four fds)
MAX_CLOSING = MAX_PEERS // 4  # links let go in one turn of the loop, closed at its end (then dials are refused)
PEER_IDLE_S = 60.0  # a link nothing was sent through this long, that nothing here needs, is closed
PRUNE_EVERY_S = 5.0  # how often idle links are looked for
REFUSALS_LOGGED_EVERY_S = 10.0  # refused dials are logged at most this often (a flood must not flood the log)


class PeerLimitError(Exception):
    """MAX_PEERS links are open and none may go now: no link to another endpoint."""


class Peers:
    def __init__(self, ctx: zmq.Context, security: Security | None, poller: zmq.Poller, counters: Counter,
                 liveness: PeerLiveness, probe_interval: float):
        self.ctx, self.security, self.poller = ctx, security, poller
        self.counters = counters  # the node's: frames dropped, links refused and closed are counted here
        self.liveness = liveness
        self.rtt = RttTable()  # round trips to peers, reported in heartbeats for the planner
        self.probe_interval = probe_interval
        self.probes: dict[str, str] = {}  # endpoint -> key of peers the tracker asked us to measure
        self.socks: dict[str, zmq.Socket] = {}  # endpoint -> the DEALER that dials it
        self.endpoint_of: dict[zmq.Socket, str] = {}  # DEALER or its link monitor -> the peer endpoint
        self.monitors: dict[str, zmq.Socket] = {}  # endpoint -> the link monitor of its DEALER
        self._used: dict[str, float] = {}  # endpoint -> when a frame last left for it; least recent first
        self._needed: set[str] = set()  # endpoints routes and sessions here needed at the last prune
        self._closing: set[zmq.Socket] = set()  # let go this turn: a poll's answer may still name them
        self._next_probe = 0.0
        self._pruned_at = float("-inf")
        self._refused = 0  # dials refused since the last log line
        self._refusal_logged_at = float("-inf")
        self._held: dict[tuple[str, str], list[list]] | None = None  # (endpoint, key) -> frames held (``batched``)

    def __contains__(self, sock: zmq.Socket) -> bool:
        return sock in self.endpoint_of

    @contextmanager
    def batched(self):
        """Hold what is sent meanwhile, then send it: each peer's messages as one BATCH (one alone as
        it is). A pass's FORWARDs to the next hop, or its TOKENs to a head, cost that peer one read
        and this node one send, not one each: at 8 streams these hand-offs sit between the nodes'
        passes."""
        if self._held is not None:  # within another: that one sends
            yield
            return
        self._held = {}
        try:
            yield
        finally:
            held, self._held = self._held, None
            for (endpoint, key), bodies in held.items():
                for at in range(0, len(bodies), p.MAX_BATCH):
                    part = bodies[at:at + p.MAX_BATCH]
                    self.send(endpoint, key, part[0] if len(part) == 1 else p.encode_batch(part), copy=False,
                              count=len(part))

    def send(self, endpoint: str, key: str, frames: list, copy: bool = True, use: bool = True,
             count: int = 1) -> None:
        """Send without ever blocking the loop: a full or bad peer loses the frame (the
        head's timeout re-sends the step), not the node. ``use``: the frame keeps the link
        open (a probe's PING does not). ``count``: the messages ``frames`` carries (a BATCH's)."""
        if self._held is not None and use:  # with copy, the bytes as they are now (the caller may reuse its buffers)
            self._held.setdefault((endpoint, key), []).append([bytes(f) for f in frames] if copy else frames)
            return
        try:
            sock = self._sock(endpoint, key)
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self.counters["dropped_frames"] += count
            log.warning("peer %s is not draining its queue; dropped a frame", endpoint)
        except PeerLimitError:
            self.counters["dropped_frames"] += count
        except (zmq.ZMQError, SecurityError) as exc:
            self.counters["dropped_frames"] += count
            log.warning("cannot send to %r: %s", endpoint, exc)
        else:
            if use:
                self._used.pop(endpoint, None)
                self._used[endpoint] = time.monotonic()

    def dial(self, endpoint: str, key: str) -> None:
        """Open the link to ``endpoint`` now (its monitor says when the peer dies), if none is."""
        try:
            self._sock(endpoint, key)
        except PeerLimitError:
            pass
        except (zmq.ZMQError, SecurityError) as exc:
            log.warning("cannot dial %r: %s", endpoint, exc)

    def resolve(self, endpoint: str, key: str) -> None:
        """Open the link to a hop a peer named, or raise ProtocolError (BAD_REQUEST) when
        ``endpoint`` is no endpoint (or ``key`` no key) ZeroMQ can dial: the peer that named it
        is told at once, not its frame dropped after the layers ran. A link refused for the
        bound (MAX_PEERS) is no fault of the name: its frame is dropped when sent, and counted."""
        try:
            self._sock(endpoint, key)
        except PeerLimitError:
            pass
        except (zmq.ZMQError, SecurityError) as exc:
            raise p.ProtocolError(f"the next hop's endpoint {endpoint!r:.200} cannot be dialled: {exc}",
                                  p.ErrorCode.BAD_REQUEST) from None

    def _sock(self, endpoint: str, key: str) -> zmq.Socket:
        sock = self.socks.get(endpoint)
        if sock is None:
            if len(self.socks) >= MAX_PEERS and not self._make_room():
                self._refuse(endpoint, f"{len(self.socks)} links open, {len(self._closing) // 2} closing, "
                                       "none unneeded")
            # a monitor of its link: the link going down = the peer died
            sock, monitor = dial_watched(self.ctx, endpoint, self.security, key, LINK_EVENTS)
            self.socks[endpoint] = sock
            self.monitors[endpoint] = monitor
            for s in (sock, monitor):  # pongs and errors come back on the DEALER
                self.endpoint_of[s] = endpoint
                self.poller.register(s, zmq.POLLIN)
            self._used[endpoint] = time.monotonic()
        return sock

    def _make_room(self) -> bool:
        """Let go of the least recently used link that nothing needs; False if none may go."""
        if len(self._closing) >= 2 * MAX_CLOSING:
            return False
        needed = self._needed | self.probes.keys()
        victim = next((e for e in self._used if e not in needed), None)
        if victim is None:
            return False
        self._let_go(victim)
        return True

    def _refuse(self, endpoint: str, why: str) -> None:
        self.counters["refused_peers"] += 1
        self._refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSALS_LOGGED_EVERY_S:
            log.warning("refused %d dial(s) (%s), the last to %r; their frames were dropped", self._refused, why,
                        endpoint[:200])
            self._refused, self._refusal_logged_at = 0, now
        raise PeerLimitError(endpoint)

    def _let_go(self, endpoint: str) -> None:
        """Stop using the link to ``endpoint``: no frame leaves on it any more, its monitor is
        stopped at once (see ``close``), the sockets are closed at the end of this turn
        (``prune``), and what was known of the peer's liveness is forgotten."""
        sock, monitor = self.socks.pop(endpoint), self.monitors.pop(endpoint)
        sock.disable_monitor()
        self._closing |= {sock, monitor}
        self._used.pop(endpoint, None)
        self.liveness.drop(endpoint)
        self.rtt.drop(endpoint)
        self.counters["closed_peers"] += 1
        log.debug("closed the link to %s", endpoint)

    def ping(self, endpoint: str, key: str, now: float) -> None:
        self.send(endpoint, key, p.encode(p.Ping(self.rtt.ping(endpoint, now))), use=False)

    def received(self, sock: zmq.Socket, frames: list) -> p.Error | None:
        """Frames read on one of our sockets: a link event, a PONG (the peer lives), or an
        ERROR about a session, which is returned for the head."""
        endpoint = self.endpoint_of[sock]
        if sock in self._closing:
            return None
        if self.monitors.get(endpoint) is sock:
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

    def prune(self, now: float, needed: Callable[[], set[str]]) -> None:
        """Close the links let go this turn; every PRUNE_EVERY_S, let go of those nothing was
        sent through for PEER_IDLE_S unless ``needed()`` (the heads of sessions here, the hops
        of routes this node heads) or the tracker's probes name them. Call it where no poll's
        answer is being read."""
        if now - self._pruned_at >= PRUNE_EVERY_S:
            self._pruned_at = now
            self._needed = needed()
            keep = self._needed | self.probes.keys()
            for endpoint in [e for e, used in self._used.items() if now - used >= PEER_IDLE_S and e not in keep]:
                self._let_go(endpoint)
        for sock in self._closing:
            self.poller.unregister(sock)
            del self.endpoint_of[sock]
            sock.close(linger=0)
        self._closing.clear()

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
        self._closing.clear()
        self._used.clear()
