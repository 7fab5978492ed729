"""The tracker process: a ROUTER for requests from nodes and clients, a PUB for updates.

Requests (``fabric.wire.protocol``) and their replies:

===================  ===========================================================
Register             Ack, or Error(BAD_REQUEST)
Heartbeat            Ack(probe=peers to measure), or Error(UNKNOWN_NODE) -- register again
RouteRequest         Route (best route), or Error(UNKNOWN_MODEL / NO_ROUTE)
Report               Ack (``detail`` is the billing status of a final report)
StatusRequest        Status(body=...) -- see ``Tracker.status_body``
AssignRequest        Assign(start_layer, end_layer)
ReplicasRequest      Replicas (nodes holding the layers an audit re-runs; maybe none)
Verdict              Ack -- a settled one excludes its suspect from plans; or Error(BAD_REQUEST)
FetchReport          Ack -- a fetch of weights from peers, shown in STATUS (``fetches``); or Error(BAD_REQUEST)
Ping                 Pong
anything malformed   Error(code) from the ProtocolError; the tracker carries on
===================  ===========================================================

PUB topics, each ``[topic, msgpack payload]``: ``plans`` (on every topology change),
``stats`` (every ``stats_interval``) and ``events`` (each console-ring insert/update).
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn

import msgpack
import zmq

from fabric.metrics import Sample, speculation_samples
from fabric.net.security import Security, peer_key, serve_securely, start_authenticator
from fabric.wire.liveness import (DEFAULT_PUB, DEFAULT_TRACKER, HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, TOPIC_EVENTS,
                                  TOPIC_PLANS, TOPIC_STATS)
from fabric.wire.protocol import (
    VERSION,
    Ack,
    Assign,
    AssignRequest,
    Error,
    ErrorCode,
    FetchReport,
    Heartbeat,
    Hop,
    Kind,
    Leave,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Register,
    ReplicasRequest,
    Report,
    Route,
    RouteRequest,
    Status,
    StatusRequest,
    Verdict,
    check_assign_request,
    decode,
    encode,
    split_envelope,
)

from .audits import Audits
from .events import EventRing
from .fetches import Fetches
from .ledger import Ledger, default_ledger_path
from .planner import (
    CostModel,
    Plan,
    assign_span,
    hop_dict,
    plan_all,
    plan_routes,
)
from .keys import KeyBook
from .reach import ReachChecker
from .node_records import NodeInfo
from .registry import Registry
from .reports import Reports
from .stats import StatsStore, route_label
from .views import node_rows, plans_view, usage

log = logging.getLogger(__name__)

STATUS_EVENTS = 50  # recent events included in a Status body
MAX_DRAIN = 100  # messages handled per poll wake-up before housekeeping runs
MAX_PROBE_PEERS = 16  # peers a heartbeat's answer asks the node to measure round trips to


@dataclass(frozen=True)
class TrackerConfig:
    bind: str = DEFAULT_TRACKER  # ROUTER address for requests ("tcp://host:*": any port)
    pub: str = DEFAULT_PUB  # PUB address for plans, stats and events
    db: Path | str = field(default_factory=default_ledger_path)  # SQLite ledger file (":memory:": none)
    heartbeat_interval: float = HEARTBEAT_INTERVAL  # seconds between a node's heartbeats
    expiry_missed: int = HEARTBEAT_LIVENESS  # missed heartbeats after which a node is dropped
    stats_interval: float = 2.0  # seconds between publications on the stats topic
    plans_interval: float = 0.5  # least seconds between two publications on the plans topic (a quarter heartbeat if less)
    event_ring: int = 200  # console events kept in memory
    max_routes: int = 3  # ranked routes per model in plans and status
    stats_window: int = 64  # samples kept per rolling statistic
    max_message_bytes: int = 4 << 20  # ZeroMQ drops larger inbound messages
    cost: CostModel = CostModel()  # the planner's cost knobs
    security: Security | None = None  # CurveZMQ keys + allow-list; None: plaintext (a trusted LAN)
    reach_timeout: float = 3.0  # seconds a node's endpoint has to answer the tracker's PING (0: never check)
    # seconds after start in which a missing route is "tracker_starting", not "no_route": the nodes of a restarted
    # tracker register again meanwhile, and clients route on what they remember (None: every heartbeat missed once)
    warmup: float | None = None


HANDLED = (Kind.REGISTER, Kind.HEARTBEAT, Kind.ROUTE_REQUEST, Kind.REPORT, Kind.STATUS_REQUEST,
           Kind.ASSIGN_REQUEST, Kind.LEAVE, Kind.REPLICAS_REQUEST, Kind.VERDICT, Kind.FETCH_REPORT)


class Tracker:
    """Registry, planner, stats, ledger and publisher behind one ZeroMQ loop.

    All state is owned by the thread that calls ``run``. ``ready`` is set once both
    sockets are bound; ``endpoint`` and ``pub_endpoint`` then hold the real addresses.
    """

    def __init__(self, config: TrackerConfig, context: zmq.Context | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.ready = threading.Event()
        self.endpoint: str | None = None
        self.pub_endpoint: str | None = None
        self._context = context
        self.registry = Registry(config.heartbeat_interval, config.expiry_missed, clock=clock)  # expiry's clock
        self.stats = StatsStore(config.stats_window)
        self.events = EventRing(config.event_ring)
        self.reports = Reports(self.registry, self.stats, self.events, config.cost, self._emit)
        self.audits = Audits(self.registry, self.events, self._emit)  # replicas for audits, and their verdicts
        self.fetches = Fetches(self.events, self._emit)  # fetches of weights from peers, as their fetchers report
        self._ledger: Ledger | None = None
        self._pub: zmq.Socket | None = None
        self._started = time.monotonic()
        self._plans_version = -1
        self._differ_warned: set[tuple[str, frozenset[str]]] = set()  # (model, fingerprints) logged once
        self._next_stats = 0.0
        self._next_plans = 0.0  # monotonic time before which plans are not published again
        self._probes: dict[str, tuple[Hop, ...]] = {}  # node id -> its probe list, for one registry version
        self._probes_version = -1
        self.keys = KeyBook(config.security)  # which key each node id belongs to (secured swarms)
        self._reach: ReachChecker | None = None  # checks registered endpoints (while running)
        self.handled: Counter[str] = Counter({k.name.lower(): 0 for k in HANDLED})  # for /metrics

    # ----------------------------------------------------------------- loop

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; sockets and the ledger are closed on every path."""
        context = self._context or zmq.Context()
        sockets: list[zmq.Socket] = []
        auth = start_authenticator(context, self.config.security) if self.config.security else None
        try:
            with Ledger(self.config.db) as ledger:
                self._ledger = ledger
                router = self._bind(context, zmq.ROUTER, self.config.bind, sockets)
                self._pub = self._bind(context, zmq.PUB, self.config.pub, sockets)
                self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
                log.info("tracker listening on %s, publishing on %s, ledger %s",
                         self.endpoint, self.pub_endpoint, self.config.db)
                if self.config.reach_timeout > 0:
                    self._reach = ReachChecker(context, self.config.security, self.config.reach_timeout)
                self.ready.set()
                self._loop(router, stop)
        finally:
            if self._reach is not None:
                self._reach.close()
                self._reach = None
            for sock in sockets:
                sock.close(linger=0)
            self._pub = self._ledger = None
            if auth is not None:
                auth.stop()
            if self._context is None:
                context.term()
            log.info("tracker stopped")

    def _bind(self, context: zmq.Context, kind: int, address: str,
              sockets: list[zmq.Socket]) -> zmq.Socket:
        sock = context.socket(kind)
        sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        serve_securely(sock, self.config.security)
        sock.bind(address)
        return sock

    def _loop(self, router: zmq.Socket, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        timeout_ms = max(10, int(min(self.config.heartbeat_interval / 4, 0.25) * 1000))
        while not stop.is_set():
            if poller.poll(timeout_ms):
                self._drain(router)
            self._housekeeping()

    def _drain(self, router: zmq.Socket) -> None:
        for _ in range(MAX_DRAIN):
            try:
                received = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            key = peer_key(received[-1]) if self.config.security else None
            envelope, reply = self.respond([f.bytes for f in received], key)
            if not envelope:
                continue
            try:
                router.send_multipart([*envelope, *encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not reply to a peer: %s", exc)

    def _housekeeping(self) -> None:
        self._expire()
        self._reach_results()
        now = time.monotonic()
        self._publish_plans(now)
        if now >= self._next_stats:
            self._next_stats = now + self.config.stats_interval
            self._publish(TOPIC_STATS, {"ts": time.time(), "stats": self.stats.snapshot(),
                                        "nodes": self._node_rows(), "fetches": self.fetches.view(),
                                        "usage": usage(self._ledger),
                                        "speculation": self.reports.speculation.view()})

    def _expire(self) -> None:
        """Drop nodes that stopped heartbeating (cheap: handlers call it before they answer)."""
        for node in self.registry.expire():
            self._forget(node.node_id)
            self._emit(self.events.add("error", f"node {node.node_id} expired (missed heartbeats)",
                                       node=node.node_id, model=node.model, code="expired"))

    def _publish_plans(self, now: float | None = None) -> None:
        """Publish every model's plans if the topology changed, at most every ``plans_interval``
        (``now`` None: at once). Planning every model costs tens of ms in a swarm of a
        thousand; replanning on each REGISTER or first heartbeat of a joining crowd would
        starve the requests behind them."""
        if self.registry.version == self._plans_version or (now is not None and now < self._next_plans):
            return
        if now is not None:
            self._next_plans = now + min(self.config.plans_interval, self.config.heartbeat_interval / 4)
        self._plans_version = self.registry.version
        plans = self._plans()
        self._warn_weights_differ(plans)
        self._publish(TOPIC_PLANS, {"ts": time.time(), "version": self._plans_version, **self._plans_view(plans)})

    def _forget(self, node_id: str) -> None:
        """Drop what the tracker keeps per node once it expired or left: its measurements,
        and its key binding, which moves to the bounded list of departed ids."""
        self.stats.forget_node(node_id)
        self.keys.departs(node_id)

    def _warn_weights_differ(self, plans: dict[str, Plan]) -> None:
        """Log and publish, once per set of fingerprints, that nodes of one model never chain
        (remembered while those fingerprints differ: the sets seen are the live ones)."""
        live = {(m, frozenset(g.fingerprint for g in p.differ)) for m, p in plans.items() if len(p.differ) > 1}
        self._differ_warned &= live
        for model, plan in plans.items():
            seen = frozenset(g.fingerprint for g in plan.differ)
            if len(seen) < 2 or (model, seen) in self._differ_warned:
                continue
            self._differ_warned.add((model, seen))
            message = f"{model}: {plan.describe_differ()}"
            log.warning("%s", message)
            self._emit(self.events.add("error", message, model=model, code="weights_differ"))

    # ----------------------------------------------------------------- dispatch

    def respond(self, frames: list[bytes], peer: str | None = None) -> tuple[list[bytes], Message]:
        """(reply envelope, reply) for one inbound ROUTER message; never raises."""
        try:
            envelope, body = split_envelope(frames)
        except ProtocolError as exc:
            return frames[:1], Error(code=exc.code, message=str(exc))
        try:
            message, _ = decode(body, max_buffer_bytes=0)
            connection = bytes(envelope[0]) if envelope else b""
            self.keys.authorize(message, peer, connection)
            return envelope, self.handle(message, peer or "", connection)
        except ProtocolError as exc:
            return envelope, Error(code=exc.code, message=str(exc))
        except Exception:  # a bug here must not take the tracker down
            log.exception("error handling a %d-frame message", len(frames))
            return envelope, Error(code=ErrorCode.INTERNAL, message="internal tracker error")

    def metrics(self) -> list[Sample]:
        """Live numbers for /metrics; safe to call from another thread."""
        nodes = self.registry.snapshot(everyone=True)
        rows = [Sample("tracker_nodes", "registered nodes", len(nodes)),
                Sample("tracker_requests_in_flight", "requests reported in progress", len(self.reports))]
        rows += [Sample("tracker_node_sessions", "sessions at the node's last heartbeat", n.sessions,
                        labels={"node": n.node_id, "model": n.model}) for n in nodes]
        rows += [Sample("tracker_messages_total", "messages handled, by kind", count, "counter", {"kind": kind})
                 for kind, count in self.handled.copy().items()]
        return rows + speculation_samples(self.reports.speculation.view(), "tracker")

    def handle(self, message: Message, peer: str = "", connection: bytes = b"") -> Message:
        """The reply to one decoded message; raises ProtocolError for a refusal."""
        if message.KIND in HANDLED:
            self.handled[message.KIND.name.lower()] += 1
        match message:
            case Register():
                return self._on_register(message, peer, connection)
            case Heartbeat():
                return self._on_heartbeat(message)
            case RouteRequest():
                return self._on_route_request(message)
            case Report():
                return self.reports.handle(message, self._ledger, peer)
            case StatusRequest():
                self._expire()
                self._publish_plans()  # what status shows, the feed shows
                return Status(body=self.status_body())
            case AssignRequest():
                return self._on_assign(message)
            case Leave():
                return self._on_leave(message)
            case ReplicasRequest():
                return self.audits.replicas(message)
            case Verdict():
                return self.audits.verdict(message)
            case FetchReport():
                return self.fetches.report(message, peer or connection.hex())
            case Ping(nonce=nonce):
                return Pong(nonce=nonce, node="tracker")
            case _:
                raise ProtocolError(f"the tracker does not handle {message.KIND.name}",
                                    ErrorCode.BAD_REQUEST)

    # ----------------------------------------------------------------- handlers

    def _on_register(self, msg: Register, peer: str = "", connection: bytes = b"") -> Message:
        old = self.registry.get(msg.node_id)
        node = self.registry.register(msg, self.keys.hop_key(msg, peer))
        self.keys.registered(node.node_id, peer, connection)
        if self._reach is not None:
            self._reach.check(node.node_id, node.endpoint, node.public_key)
        if old is not None and old.fingerprint != node.fingerprint:
            self.stats.forget_node(node.node_id)
        self._expire()  # the loop publishes the plans with it
        return Ack(detail=f"registered {node.node_id} layers {node.start_layer}-{node.end_layer}")

    def _on_heartbeat(self, msg: Heartbeat) -> Message:
        node = self.registry.heartbeat(msg)
        if node is None:
            return Error(code=ErrorCode.UNKNOWN_NODE, node=msg.node_id,
                         message=f"node {msg.node_id!r} is not registered; register again")
        return Ack(probe=self._probes_for(node), reachable=node.reachable is not False)

    def _on_leave(self, msg: Leave) -> Message:
        """A node leaves politely: out of the plans now, not after missed heartbeats."""
        node = self.registry.remove(msg.node_id)
        if node is None:
            return Ack(detail="unknown node")
        self._forget(node.node_id)
        log.info("node %s left", node.node_id)
        self._emit(self.events.add("left", f"node {node.node_id} left", node=node.node_id, model=node.model,
                                   code="left"))
        self._expire()  # the loop publishes the plans without it
        return Ack(detail="left")

    def _reach_results(self) -> None:
        for result in self._reach.results() if self._reach is not None else ():
            node = self.registry.set_reachable(result.node_id, result.endpoint, result.reachable)
            if node is not None and not result.reachable:
                self._emit(self.events.add(
                    "error", f"node {node.node_id} is not reachable at {node.endpoint} (behind NAT? it needs "
                    f"--advertise or a relay)", node=node.node_id, model=node.model, code="unreachable"))

    def _probes_for(self, node: NodeInfo) -> tuple[Hop, ...]:
        """The peers a node could hand off to or from in a route (shards that touch or
        overlap its own, and head <-> tail for the token's return): it keeps measuring its
        round trips to them. Kept per node until the topology changes: every heartbeat asks."""
        if self._probes_version != self.registry.version:
            self._probes.clear()
            self._probes_version = self.registry.version
        probes = self._probes.get(node.node_id)
        if probes is None:
            peers = [n for n in self.registry.snapshot() if n.node_id != node.node_id and n.model == node.model
                     and n.fingerprint == node.fingerprint and n.num_layers == node.num_layers
                     and _neighbours(node, n)]
            probes = self._probes[node.node_id] = tuple(
                Hop(n.node_id, n.endpoint, n.start_layer, n.end_layer, key=n.public_key) for n in peers[:MAX_PROBE_PEERS])
        return probes

    def _on_route_request(self, msg: RouteRequest) -> Message:
        self._expire()
        if msg.model not in self.registry.models():
            self._route_error(msg, ErrorCode.UNKNOWN_MODEL, f"no node serves model {msg.model!r}")
        plan = plan_routes(self.registry.snapshot(), msg.model, exclude=msg.exclude,
                           max_routes=1, throughput=self.stats.layer_rates(), cost=self.config.cost)
        best = plan.best
        if best is None:
            self._route_error(msg, ErrorCode.NO_ROUTE, plan.describe_missing())
        hops = [hop_dict(h) for h in best.hops]
        self._emit(self.events.add(
            "route selected", f"route selected for {msg.model}: {route_label(best.hops)} "
            f"(~{best.estimated_tps:.1f} tok/s)", model=msg.model, hops=hops,
            estimated_tps=best.estimated_tps, exclude=list(msg.exclude)))
        return Route(model=msg.model, hops=best.hops, estimated_tps=best.estimated_tps)

    def _route_error(self, msg: RouteRequest, code: str, text: str) -> NoReturn:
        age, warmup = time.monotonic() - self._started, self.config.warmup
        if age < (self.config.heartbeat_interval * self.config.expiry_missed if warmup is None else warmup):
            code, text = ErrorCode.TRACKER_STARTING, f"{text} (the tracker started {age:.1f} s ago: nodes register)"
        self._emit(self.events.add("error", text, model=msg.model, code=code,
                                   exclude=list(msg.exclude)))
        raise ProtocolError(text, code)

    def _on_assign(self, msg: AssignRequest) -> Message:
        check_assign_request(msg)
        start, end = assign_span(self.registry.snapshot(), msg.model, msg.num_layers, msg.max_layers)
        return Assign(start_layer=start, end_layer=end)

    # ----------------------------------------------------------------- views

    def _plans(self) -> dict[str, Plan]:
        return plan_all(self.registry.snapshot(), self.stats.layer_rates(),
                        self.config.max_routes, self.config.cost)

    def _plans_view(self, plans: dict[str, Plan] | None = None) -> dict:
        return plans_view(self._plans() if plans is None else plans, self.registry.snapshot(), self.stats)

    def status_body(self) -> dict:
        """Everything ``meshnet status --json`` shows; msgpack- and JSON-friendly."""
        return {
            "tracker": {"protocol": VERSION, "uptime_s": round(time.monotonic() - self._started, 3),
                        "endpoint": self.endpoint, "pub": self.pub_endpoint,
                        "heartbeat_interval": self.config.heartbeat_interval,
                        "expiry_s": self.registry.expiry_s},
            "nodes": self._node_rows(),
            **self._plans_view(),
            "fetches": self.fetches.view(),
            "events": self.events.recent(limit=STATUS_EVENTS),
            "stats": self.stats.snapshot(),
            "usage": usage(self._ledger),
            "speculation": self.reports.speculation.view(),
        }

    def _node_rows(self) -> list[dict]:
        """Node rows, each named by a fetch from peers for sending bad bytes marked (``bad_bytes``:
        how many listed fetches caught it; reported, not proven: it stays planned)."""
        rows, named = node_rows(self.registry, self.stats, self.config.cost), self.fetches.named()
        for row in rows:
            if row["id"] in named:
                row["bad_bytes"] = named[row["id"]]
        return rows

    # ----------------------------------------------------------------- publishing

    def _emit(self, event: dict) -> None:
        self._publish(TOPIC_EVENTS, event)

    def _publish(self, topic: bytes, payload: Any) -> None:
        if self._pub is None:
            return
        try:
            self._pub.send_multipart([topic, msgpack.packb(payload, use_bin_type=True)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("dropped a %s publication: %s", topic.decode(), exc)


def _neighbours(a: NodeInfo, b: NodeInfo) -> bool:
    """Whether some route could hand off between ``a`` and ``b`` (either way)."""
    touching = a.start_layer <= b.end_layer + 1 and b.start_layer <= a.end_layer + 1
    last = a.num_layers - 1
    head_tail = (a.start_layer == 0 and b.end_layer == last) or (b.start_layer == 0 and a.end_layer == last)
    return touching or head_tail


def serve(config: TrackerConfig, tracker: Tracker | None = None) -> None:
    """Run a tracker (``tracker``, or a new one) in this (main) thread until SIGINT or
    SIGTERM, then exit cleanly."""
    stop = threading.Event()

    def _request_stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping the tracker", signum)
        stop.set()

    previous = {sig: signal.signal(sig, _request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        (tracker or Tracker(config)).run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
