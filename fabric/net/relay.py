"""Relays: how a node that cannot accept inbound connections (NAT, a firewall) serves.

The relay process binds a control ROUTER. A relayed node dials it with a DEALER (an
outbound connection, which works behind NAT) and sends ``RELAY_OPEN(node_id)``; the
relay binds a fresh public ROUTER for that node, its **front**, and answers
``RELAY_OPENED(node_id, endpoint)``. The node registers the front's endpoint as its own.

Frames are passed, never decoded, between the two::

    peer --[id, *frames]--> front ROUTER  ==>  control ROUTER --[id, *frames]--> node DEALER
    peer <--[*frames]------ front ROUTER  <==  control ROUTER <--[id, *frames]-- node DEALER

so on its relay DEALER the node receives exactly what its own ROUTER would give it (the
sending peer's identity, then the message), and answers by sending the identity back
first. Control messages between the node and the relay travel on the same link behind
an empty first frame (ROUTER identities are never empty): ``["", MAGIC, kind, header]``.

Keepalive: the node repeats RELAY_OPEN every ``interval``; the relay answers each one
and closes a front whose node sent nothing for ``node_timeout`` (peers connected to the
front then see their link drop, as if the node had died). A node whose relay stops
answering dials it afresh and re-opens, asking for the same front endpoint again.

Security: with keys the control ROUTER and every front are CURVE servers with the
relay's key pair and its ZAP allow-list; the node and its peers are CURVE clients of the
relay. Encryption is hop by hop: the relay decrypts and re-encrypts every frame, so it
must be a trusted member of the swarm.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from ..metrics import Sample
from ..wire import protocol as p
from ..wire.protocol import endpoint_host
from .security import Security, dial, peer_key, serve_securely, start_authenticator

log = logging.getLogger(__name__)

CONTROL = b""  # first frame of a control message on the relay link
COUNTERS = ("frames_in", "frames_out", "dropped_frames", "rejected_frames", "fronts_opened", "fronts_closed")


class RelayedPeer(bytes):
    """The identity of a peer that reached this node through its relay's front (replies
    go back on the relay link, not on the node's own ROUTER)."""


@dataclass(frozen=True)
class RelayConfig:
    bind: str = "tcp://127.0.0.1:5557"  # control ROUTER that relayed nodes dial
    front_host: str | None = None  # interface fronts bind on; default: the host of ``bind``
    advertise_host: str | None = None  # host peers dial fronts at; default: the front host
    front_ports: tuple[int, int] | None = None  # inclusive port range for fronts (a firewall's); None: any
    node_timeout: float = 5.0  # close a front whose node sent nothing for this long
    max_fronts: int = 256  # nodes one relay serves at most
    max_message_bytes: int = 80 << 20  # ZeroMQ drops larger inbound messages
    security: Security | None = None  # CurveZMQ keys + allow-list; None: plaintext


@dataclass
class Front:
    """One relayed node: its public ROUTER and the identity of its link on the control socket."""

    node_id: str
    sock: zmq.Socket
    endpoint: str
    link: bytes
    owner: str | None  # CURVE key of the node that opened it (secured swarms)
    last_seen: float


def endpoint_port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[-1]


class Relay:
    """The relay process's loop. One thread owns every socket; ``ready`` is set once the
    control socket is bound (``endpoint`` then holds its real address)."""

    def __init__(self, config: RelayConfig, ctx: zmq.Context | None = None):
        self.config = config
        self.ready = threading.Event()
        self.endpoint: str | None = None
        self._ctx = ctx
        self._sock_ctx: zmq.Context | None = None  # the context fronts are made in (set by run)
        self._poller: zmq.Poller | None = None
        self.fronts: dict[str, Front] = {}  # node id -> front
        self._by_link: dict[bytes, Front] = {}
        self._by_sock: dict[zmq.Socket, Front] = {}
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self._fronts_gauge = 0  # read by metrics() from another thread

    # -- loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        ctx = self._ctx or zmq.Context()
        auth = start_authenticator(ctx, self.config.security) if self.config.security else None
        control = ctx.socket(zmq.ROUTER)
        try:
            self._setup(control)
            control.bind(self.config.bind)
            self.endpoint = control.getsockopt_string(zmq.LAST_ENDPOINT)
            self._sock_ctx = ctx
            log.info("relay listening on %s", self.endpoint)
            self.ready.set()
            self._loop(control, stop)
        finally:
            for front in list(self.fronts.values()):
                self._close(front, "relay stopping")
            control.close(linger=0)
            if auth is not None:
                auth.stop()
            if self._ctx is None:
                ctx.term()
            log.info("relay stopped")

    def _setup(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 10000)
        serve_securely(sock, self.config.security)

    def _loop(self, control: zmq.Socket, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        self._poller = poller
        next_sweep = 0.0
        while not stop.is_set():
            for sock, _ in poller.poll(100):
                if sock is control:
                    self._drain_control(control)
                elif sock in self._by_sock:
                    self._drain_front(self._by_sock[sock], control)
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + min(1.0, self.config.node_timeout / 4)
                self._sweep(now)

    # -- control socket -----------------------------------------------------------------

    def _drain_control(self, control: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = control.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_control(control, frames)
            except Exception:  # a bug must cost one frame, never the relay
                log.exception("failed handling a frame on the control socket")

    def _on_control(self, control: zmq.Socket, frames: list) -> None:
        link = frames[0].bytes
        if len(frames) >= 2 and frames[1].bytes != CONTROL:  # a node's reply to one of its peers
            self._to_front(control, link, frames[1:])
            return
        try:
            msg, _ = p.decode(frames[2:], max_buffer_bytes=0)
            reply = self._control(msg, link, peer_key(frames[-1]) if self.config.security else None)
        except p.ProtocolError as exc:
            self.counters["rejected_frames"] += 1
            log.warning("rejected a control frame: %s", exc)
            reply = p.Error(exc.code, str(exc), node="relay")
        self._send_control(control, link, reply)

    def _control(self, msg: p.Message, link: bytes, key: str | None) -> p.Message:
        match msg:
            case p.RelayOpen():
                front = self._open(msg, link, key)
                return p.RelayOpened(node_id=front.node_id, endpoint=front.endpoint, key=self._public_key)
            case p.Ping(nonce=nonce):
                return p.Pong(nonce=nonce, node="relay", sessions=len(self.fronts))
            case _:
                raise p.ProtocolError(f"a relay does not accept {type(msg).__name__}", p.ErrorCode.BAD_REQUEST)

    @property
    def _public_key(self) -> str:
        return self.config.security.public_text if self.config.security else ""

    def _send_control(self, control: zmq.Socket, link: bytes, reply: p.Message) -> None:
        try:
            control.send_multipart([link, CONTROL, *p.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not answer a relayed node: %s", exc)

    def _to_front(self, control: zmq.Socket, link: bytes, frames: list) -> None:
        front = self._by_link.get(link)
        if front is None:  # a relay that restarted: tell the node to open its front again
            self._send_control(control, link, p.Error(p.ErrorCode.UNKNOWN_NODE, "no front is open for this link; "
                                                      "send RELAY_OPEN", node="relay"))
            return
        front.last_seen = time.monotonic()
        try:
            front.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            self.counters["frames_out"] += 1
        except zmq.ZMQError:
            self.counters["dropped_frames"] += 1

    # -- fronts -------------------------------------------------------------------------

    def _open(self, msg: p.RelayOpen, link: bytes, key: str | None) -> Front:
        """The front for ``msg.node_id``: refreshed, moved to this link, or bound afresh."""
        now = time.monotonic()
        front = self.fronts.get(msg.node_id)
        if front is not None:
            if self.config.security is not None and front.owner != key:
                raise p.ProtocolError(f"node id {msg.node_id!r} belongs to another key", p.ErrorCode.BAD_REQUEST)
            if front.link != link:  # the node dialled again (new DEALER): same front, new link
                self._by_link.pop(front.link, None)
                front.link = link
                self._by_link[link] = front
            front.last_seen = now
            return front
        if len(self.fronts) >= self.config.max_fronts:
            raise p.ProtocolError(f"this relay serves at most {self.config.max_fronts} nodes", p.ErrorCode.BUSY)
        stale = self._by_link.pop(link, None)  # one link, one node
        if stale is not None:
            self._close(stale, "its link opened another front")
        sock, endpoint = self._bind_front(msg.endpoint)
        front = Front(msg.node_id, sock, endpoint, link, key, now)
        self.fronts[front.node_id] = front
        self._by_link[link] = front
        self._by_sock[sock] = front
        self._poller.register(sock, zmq.POLLIN)
        self.counters["fronts_opened"] += 1
        self._fronts_gauge = len(self.fronts)
        log.info("opened front %s for node %s", endpoint, msg.node_id)
        return front

    def _bind_front(self, wanted: str) -> tuple[zmq.Socket, str]:
        """A public ROUTER on the front host: on the port the node had before if that
        endpoint is this relay's and the port is free, else on a free port (of the range)."""
        sock = self._sock_ctx.socket(zmq.ROUTER)
        self._setup(sock)
        host = self.config.front_host or endpoint_host(self.endpoint or self.config.bind)
        advertise = self.config.advertise_host or host
        for port in self._front_ports(wanted, advertise):
            try:
                sock.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError:
                continue
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            return sock, f"tcp://{advertise}:{endpoint_port(bound)}"
        sock.close(linger=0)
        raise p.ProtocolError(f"no free port for a front on {host}", p.ErrorCode.BUSY)

    def _front_ports(self, wanted: str, advertise: str) -> list[str]:
        """Ports to try: the node's old one first (if it is this relay's), then the range or any."""
        span = self.config.front_ports
        ports = [str(n) for n in range(span[0], span[1] + 1)] if span else ["*"]
        old = endpoint_port(wanted) if wanted and endpoint_host(wanted) == advertise else ""
        if old.isdigit() and (span is None or span[0] <= int(old) <= span[1]):
            ports.insert(0, old)
        return ports

    def _drain_front(self, front: Front, control: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = front.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                control.send_multipart([front.link, *frames], zmq.NOBLOCK, copy=False)
                self.counters["frames_in"] += 1
            except zmq.ZMQError:
                self.counters["dropped_frames"] += 1

    def _sweep(self, now: float) -> None:
        for front in [f for f in self.fronts.values() if now - f.last_seen > self.config.node_timeout]:
            self._close(front, f"its node sent nothing for {self.config.node_timeout:.1f} s")

    def _close(self, front: Front, why: str) -> None:
        self.fronts.pop(front.node_id, None)
        if self._by_link.get(front.link) is front:
            del self._by_link[front.link]
        self._by_sock.pop(front.sock, None)
        if self._poller is not None:
            self._poller.unregister(front.sock)
        front.sock.close(linger=0)
        self.counters["fronts_closed"] += 1
        self._fronts_gauge = len(self.fronts)
        log.info("closed front %s of node %s: %s", front.endpoint, front.node_id, why)

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> list[Sample]:
        """Live numbers for /metrics; safe to call from another thread."""
        c = self.counters.copy()
        rows = [Sample("relay_fronts", "relayed nodes with an open front", self._fronts_gauge)]
        rows += [Sample(f"relay_{name}_total", name.replace("_", " "), c[name], "counter") for name in COUNTERS]
        return rows


class RelayLink:
    """A relayed node's side of its relay: one DEALER to the relay's control socket.

    The node polls ``sock`` next to its own ROUTER. ``receive`` sorts what arrives into
    peer frames (with a ``RelayedPeer`` identity) and the relay's control answers;
    ``tick`` sends the keepalive and, when the relay has been silent for ``timeout``,
    dials it afresh (the caller re-registers ``sock`` with its poller).
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, node_id: str, *, security: Security | None = None,
                 key: str | bytes | None = None, interval: float = 1.0, timeout: float = 3.0):
        self.ctx, self.relay, self.node_id = ctx, endpoint, node_id
        self.security, self.key = security, key
        self.interval, self.timeout = interval, timeout
        self.front: str = ""  # the public endpoint the relay opened for this node ("" until then)
        self.front_key: str = ""  # the key peers dial the front with
        self.up = False  # the relay answered within ``timeout``
        self.reopened = False  # set when the front (re)opened; the node re-registers and clears it
        self._heard = time.monotonic()
        self._next_open = 0.0
        self.sock = self._dial()

    def _dial(self) -> zmq.Socket:
        return dial(self.ctx, self.relay, self.security, self.key)

    def close(self) -> None:
        self.sock.close(linger=0)

    def tick(self, now: float) -> zmq.Socket | None:
        """Keepalive. When the relay has been silent for ``timeout`` the link is dialled
        afresh: returns the old socket, which the caller unregisters and closes."""
        old = None
        if now - self._heard > self.timeout:
            if self.up:
                log.warning("relay %s silent for %.1f s: dialling it again", self.relay, now - self._heard)
            self.up = False
            old, self.sock = self.sock, self._dial()
            self._heard, self._next_open = now, 0.0
        if now >= self._next_open:
            self._next_open = now + self.interval
            self._control(p.RelayOpen(self.node_id, self.front))
        return old

    def receive(self, frames: list) -> tuple[RelayedPeer, list] | p.Message | None:
        """Peer frames as (identity, body), or the relay's decoded control answer, or None."""
        if len(frames) < 2:
            return None
        first = frames[0].bytes
        if first != CONTROL:
            return RelayedPeer(first), frames[1:]
        try:
            msg, _ = p.decode(frames[1:], max_buffer_bytes=0)
        except p.ProtocolError as exc:
            log.warning("bad control frame from relay %s: %s", self.relay, exc)
            return None
        self._heard = time.monotonic()
        match msg:
            case p.RelayOpened() if msg.node_id == self.node_id:
                if msg.endpoint != self.front or not self.up:
                    self.reopened = True
                    log.info("relay %s opened front %s for this node", self.relay, msg.endpoint)
                self.front, self.front_key, self.up = msg.endpoint, msg.key, True
            case p.Error(code=p.ErrorCode.UNKNOWN_NODE):  # the relay restarted: open again now
                self.up, self._next_open = False, 0.0
            case p.Error():
                log.warning("relay %s: %s: %s", self.relay, msg.code, msg.message)
        return msg

    def send(self, identity: bytes, frames: list, copy: bool = True) -> None:
        """Frames to the peer ``identity`` (a reply), out of the front."""
        try:
            self.sock.send_multipart([bytes(identity), *frames], zmq.NOBLOCK, copy=copy)
        except zmq.ZMQError as exc:
            log.warning("relay link is not draining: dropped a reply (%s)", exc)

    def _control(self, msg: p.Message) -> None:
        try:
            self.sock.send_multipart([CONTROL, *p.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the relay is not reading; the timeout re-dials it


def serve_relay(config: RelayConfig, relay: Relay | None = None) -> None:
    """Run a relay in this (main) thread until SIGINT or SIGTERM."""
    import signal

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        (relay or Relay(config)).run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
