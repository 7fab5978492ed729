"""A node's links out of the data path: to the tracker, and to its relay.

To the tracker the node registers, heartbeats (sessions, queue, round trips to peers),
reports requests it heads and asks for failover routes; the tracker's answers come back
here. A node that peers cannot dial opens a front on a relay, which hands it the frames
peers send to that front. Neither link ever carries a hidden state of ours.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import zmq

from ..net.relay import RelayedPeer, RelayLink
from ..net.security import Security
from ..net.tracker_link import TrackerLink
from ..wire.liveness import DEFAULT_TRACKER, HEARTBEAT_INTERVAL
from ..wire import protocol as p

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkConfig:
    tracker: str | None = DEFAULT_TRACKER  # None: run without a tracker (tests, scripts)
    heartbeat_interval: float = HEARTBEAT_INTERVAL  # seconds between heartbeats to the tracker
    probe_interval: float = 2.0  # seconds between round-trip probes of peers outside active routes
    relay: str | None = None  # a relay's control endpoint: peers reach this node through the relay's front
    relay_fallback: str | None = None  # a relay to switch to if the tracker cannot reach the advertised endpoint
    relay_key: str = ""  # the relay's CURVE public key (secured swarms); "": the tracker's key
    relay_interval: float = 1.0  # seconds between keepalives (RELAY_OPEN) to the relay
    relay_timeout: float = 3.0  # a relay silent this long is dialled again (and heartbeats pause)


class LinkHost(Protocol):
    """What the links need of their node."""

    endpoint: str
    key: str

    def registration(self) -> p.Register: ...
    def heartbeat(self) -> p.Heartbeat: ...
    def inbound(self, identity: bytes, frames: list) -> int: ...  # a peer's frame through the relay; the messages read
    def route_answer(self, msg: p.Route | p.Error) -> None: ...  # the answer to a failover request
    def replicas(self, msg: p.Replicas) -> None: ...  # the answer to an audit's question for replicas
    def probe(self, peers: dict[str, str]) -> None: ...  # endpoint -> key of peers to time


class Links:
    def __init__(self, config: LinkConfig, ctx: zmq.Context, security: Security | None, poller: zmq.Poller,
                 node_id: str, host: LinkHost):
        self.config, self.ctx, self.security, self.poller = config, ctx, security, poller
        self.node_id, self.host = node_id, host
        self.tracker: TrackerLink | None = None  # the DEALER to the tracker and what its silence means
        self.relay: RelayLink | None = None  # the link to our relay, when peers cannot dial us
        self._next_heartbeat = 0.0
        self._registered_at = float("-inf")  # when the last REGISTER went out
        self._warned_unreachable = False
        self.leaving = False  # LEAVE sent: no more heartbeats, and no registering again

    def open(self, stop: threading.Event) -> None:
        """Open the relay's front (waiting for it), then dial the tracker and register."""
        if self.config.relay:
            self._open_relay(stop)
        if self.config.tracker:
            self.tracker = TrackerLink(self.ctx, self.config.tracker, self.security)
            self.poller.register(self.tracker.sock, zmq.POLLIN)
            self.poller.register(self.tracker.monitor, zmq.POLLIN)
            self._register()

    def close(self) -> None:
        for link in (self.tracker, self.relay):
            if link is not None:
                link.close()

    def owns(self, sock: zmq.Socket) -> bool:
        return ((self.tracker is not None and sock in (self.tracker.sock, self.tracker.monitor))
                or (self.relay is not None and sock is self.relay.sock))

    def received(self, sock: zmq.Socket, frames: list) -> None:
        if self.relay is not None and sock is self.relay.sock:
            self._relay_frames(frames)
        elif sock is self.tracker.monitor:
            self.tracker.on_monitor(frames)
        else:
            self._tracker_reply(frames)

    def send(self, message: p.Message) -> bool:
        """To the tracker; False when this node has none."""
        if self.tracker is None:
            return False
        self.tracker.send(message)
        return True

    def leave(self) -> None:
        """Tell the tracker this node leaves: plans drop it now. Heartbeats stop, so that an
        ``unknown_node`` answer never registers it again."""
        self.leaving = True
        self.send(p.Leave(self.node_id))

    def tick(self, now: float) -> None:
        if self.tracker is not None and now >= self._next_heartbeat and self.reachable() and not self.leaving:
            self._next_heartbeat = now + self.config.heartbeat_interval
            self.send(self.host.heartbeat())
        if self.tracker is not None:
            self.tracker.check(now)
        self._relay_tick(now)

    def _register(self) -> None:
        self._registered_at = time.monotonic()
        self.send(self.host.registration())

    def reachable(self) -> bool:
        """Whether peers can reach this node: always, unless its relay is down (then it
        stops heartbeating, so the tracker drops it from plans until the relay is back)."""
        return self.relay is None or self.relay.up

    def reply_relayed(self, identity: RelayedPeer, frames: list) -> None:
        self.relay.send(identity, frames)

    # -- tracker ------------------------------------------------------------------------

    def _tracker_reply(self, frames: list) -> None:
        try:
            msg, _ = p.decode(frames)
        except p.ProtocolError as exc:
            log.warning("bad frame from tracker: %s", exc)
            return
        self.tracker.answered(msg)
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.UNKNOWN_NODE:
            # heartbeats queued while the tracker was away are answered at once: register once for them all
            if not self.leaving and time.monotonic() - self._registered_at >= self.config.heartbeat_interval:
                log.info("tracker does not know this node (restarted?): registering again")
                self._register()
        elif isinstance(msg, p.Route) or (isinstance(msg, p.Error) and msg.code in p.NO_ROUTE_CODES):
            self.host.route_answer(msg)
        elif isinstance(msg, p.Replicas):
            self.host.replicas(msg)
        elif isinstance(msg, p.Ack):
            if msg.probe:
                self.host.probe({h.endpoint: h.key for h in msg.probe
                                 if h.node != self.node_id and h.endpoint != self.host.endpoint})
            if not msg.reachable:
                self._unreachable()

    # -- relay --------------------------------------------------------------------------

    def _start_relay(self, endpoint: str) -> None:
        """Dial the relay at ``endpoint``; its RELAY_OPENED gives us our public endpoint."""
        c = self.config
        key = c.relay_key or (self.security.tracker_key if self.security else None)
        self.relay = RelayLink(self.ctx, endpoint, self.node_id, security=self.security, key=key,
                               interval=c.relay_interval, timeout=c.relay_timeout)
        self.poller.register(self.relay.sock, zmq.POLLIN)
        log.info("node %s: opening a front on relay %s", self.node_id, endpoint)

    def _unreachable(self) -> None:
        """The tracker could not reach our endpoint: peers cannot either. Fall back to the
        configured relay (once), or say what is wrong."""
        if self.relay is not None:
            return
        if self.config.relay_fallback:
            log.warning("the tracker cannot reach this node at %s: switching to relay %s", self.host.endpoint,
                        self.config.relay_fallback)
            self._start_relay(self.config.relay_fallback)
        elif not self._warned_unreachable:
            self._warned_unreachable = True
            log.warning("the tracker cannot reach this node at %s, so peers cannot either: give an endpoint "
                        "they can dial (--advertise) or a relay (--relay, --relay-fallback)", self.host.endpoint)

    def _open_relay(self, stop: threading.Event) -> None:
        """Dial the relay and wait until it opened our front: the endpoint peers dial."""
        self._start_relay(self.config.relay)
        while not stop.is_set() and not self.relay.up:
            self._relay_tick(time.monotonic())
            if self.relay.sock.poll(100):
                for _ in range(256):
                    try:
                        self._relay_frames(self.relay.sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break

    def _relay_tick(self, now: float) -> None:
        if self.relay is None:
            return
        old = self.relay.tick(now)
        if old is not None:  # the relay went silent: the link was dialled afresh
            self.poller.unregister(old)
            old.close(linger=0)
            self.poller.register(self.relay.sock, zmq.POLLIN)

    def _relay_frames(self, frames: list) -> None:
        got = self.relay.receive(frames)
        if isinstance(got, tuple):  # a peer's frame through our front, like one on our ROUTER
            self.host.inbound(*got)
        elif isinstance(got, p.RelayOpened) and self.relay.reopened:
            self.relay.reopened = False
            self.host.endpoint = self.relay.front
            if self.security is not None:
                self.host.key = self.relay.front_key  # hops answer a relayed head through the relay
            self._register()
