"""The node daemon's socket loop: poll, decode frames, hand them to the part whose job
they are, run the hops the scheduler picks, send what comes out.

One thread owns every socket and the model. Inbound frames arrive on a ROUTER; frames to
peers leave through one DEALER per peer endpoint (``Peers``). Hops are queued in the
``HopScheduler`` and run between polls by the ``HopRunner``, so a node keeps answering
while it computes for many sessions. When this node is the head of a request, its
``Head`` sends the first hop to this very node: such frames are queued in-process instead
of crossing a socket. The tracker and relay are the ``Links``.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections import Counter

import torch
import zmq

from ..compute.compute_lock import ComputeLock, Members
from ..compute.executor import ShardExecutor
from ..compute.grammar import Grammars
from ..compute.heap import release_freed_memory
from ..compute.kv import KVStore, default_budget
from ..compute.models import fingerprint, load_shard, load_tokenizer
from ..compute.tensors import TORCH_DTYPES, from_wire, to_wire
from ..metrics import Sample
from ..net.peer_liveness import PeerLiveness
from ..net.security import serve_securely, start_authenticator
from ..wire import protocol as p
from ..wire.liveness import KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_PROBES, PEER_SILENCE
from . import telemetry
from .asks import SessionAsks
from .config import NodeConfig
from .draft_model import DraftModel
from .head import Head, ServedModel
from .hops import HopRunner, decodes_at_once
from .housekeeping import Housekeeping
from .idle_trim import IdleTrim
from .leave import Departure
from .links import Links
from .owners import SELF, Owners
from .pass_on import PassOn
from .peers import Peers
from .prefixes import MAX_PREFIXES, PrefixIndex
from .replies import Replies
from .route_session import eos_ids
from .scheduler import HopScheduler, Replay, Work
from .session_control import SessionControl
from .share import WeightShare
from .taps import Taps, kernels
from .telemetry import COUNTERS

log = logging.getLogger(__name__)

TAP_KIND = bytes([p.Kind.AUDIT_TAP])  # the kind frame of an AUDIT_TAP
MAX_DRAIN = 256  # messages read from one socket before the loop runs work again


class Node(PassOn, SessionControl, Replies):
    def __init__(self, config: NodeConfig, ctx: zmq.Context | None = None):
        self.config = config
        # a secured node owns its context: one ZAP handler per context
        self._own_ctx = ctx is None and config.security is not None
        self.ctx = ctx or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        weights = load_shard(config.source, config.shard, dtype=config.dtype, device=config.device,
                             progress=config.progress, cache_root=config.cache_root, quant=config.quant)
        budget = default_budget(config.device) if config.kv_cache_bytes is None else config.kv_cache_bytes
        self.kv = KVStore(config.kv_idle_timeout, retain_bytes=budget)
        self.executor = ShardExecutor(weights, self.kv)
        self.fingerprint = fingerprint(config.source, weights.config, config.quant, config.cache_root)
        self.share = WeightShare(config.source, config.source.model_id, config.node_id, config.shard.num_layers,
                                 config.share_bytes_per_s, config.cache_root)  # its file, to peers fetching layers
        self.context = getattr(weights.config, "max_position_embeddings", 0) or 0  # positions a session may reach
        self.vocab = getattr(weights.config, "vocab_size", 0) or 0  # token ids are below this
        # hops, cache misses, failovers, errors: for /metrics and tests. Every key exists from
        # the start, so another thread can copy the counter while this one updates it.
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self._lock = ComputeLock(config.compute_lock)
        self.hops = HopRunner(self.executor, self._lock, self.counters, config.decode_threads or 0,
                              members=self._members(config))
        self.taps = Taps(self.executor, self._lock, config.node_id, kernels(config.device, config.dtype, config.quant),
                         self.counters)
        self.scheduler = HopScheduler(config.scheduler, self.kv, self.executor.batchable, self._lock.shared,
                                      gather=not self.hops.decode_threads)
        self.benchmark = self.hops.benchmark(config.shard, config.dtype)
        if config.tune_threads:
            self.hops.tune_step_threads(config.shard, config.dtype)
        self.auth = start_authenticator(self.ctx, config.security) if config.security else None
        self.key = config.security.public_text if config.security else ""  # peers dial us with it
        self.router = bound_router(self.ctx, config)
        self._gone: set[bytes] = set()  # identities whose connection closed, for the head
        self._taps: list[list[zmq.Frame]] = []  # AUDIT_TAPs read this turn of the loop, answered after its batch
        self.endpoint = config.advertise or self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.poller = zmq.Poller()
        h = config.head
        self.peers = Peers(self.ctx, config.security, self.poller, self.counters,
                           PeerLiveness(h.ping_interval, h.peer_silence, h.link_grace), config.link.probe_interval)
        self.links = Links(config.link, self.ctx, config.security, self.poller, config.node_id, self)
        self.head = self._head(weights.config) if config.shard.is_first else None
        self.departure = Departure(config.node_id, config.drain_timeout)  # a polite leave, once asked
        self.owners = Owners()  # the connection each session here was opened by
        self.asks = SessionAsks(tail_grammars(config, self.vocab, weights.config) if config.shard.is_last else None)
        self.ready, self.idle_trim, self.housekeeping = threading.Event(), IdleTrim(), Housekeeping()  # see their modules
        gc.collect()
        # What loading made lives as long as the node: out of the collector's sight, a full collection
        # (about a quarter of a million objects, 140-170 ms here) no longer stalls a stream's token
        gc.freeze()
        release_freed_memory()  # what loading, the tokenizer and the benchmark left behind goes back to the OS

    @staticmethod
    def _members(config: NodeConfig) -> Members | None:
        """Without ``decode_threads`` (None), the nodes sharing this machine's compute lock, where
        this node decodes at once by default: its decode threads follow their count."""
        if config.decode_threads is None and decodes_at_once(config.device, config.quant, config.shard):
            return Members(config.compute_lock)
        return None

    def _head(self, model_config) -> Head:
        tokenizer = load_tokenizer(self.config.source, self.config.cache_root)
        model = ServedModel(self.config.source.model_id, self.config.shard.num_layers, tokenizer,
                      eos_ids(tokenizer, model_config), vocab_size=self.vocab, context=self.context,
                      fingerprint=self.fingerprint)
        # a node that keeps no KV of ended requests offers none to reuse either
        prefixes = PrefixIndex(max_entries=0 if self.kv.retained.budget <= 0 else MAX_PREFIXES)
        return Head(self.config.head, self, self.config.node_id, model, self.counters, prefixes=prefixes,
                    audit=self.config.audit, draft=draft_model(self.config, tokenizer, self.vocab))

    # -- main loop ----------------------------------------------------------------------

    def run(self, stop: threading.Event, leave: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set, or after ``leave`` is set, until the sessions served end."""
        self.poller.register(self.router, zmq.POLLIN)
        lock = self._lock.fileno()  # readable when the compute lock, waited for off this thread, is ours
        if lock is not None:
            self.poller.register(lock, zmq.POLLIN)
        self.links.open(stop)
        log.info("node %s serving layers %s of %s at %s", self.config.node_id, self.config.shard,
                 self.config.source.model_id, self.endpoint)
        self.ready.set()
        try:
            while not stop.is_set() and not (leave is not None and leave.is_set() and self._leave_and_drain()):
                share = self.share.wait(now := time.monotonic())  # None: no chunk waits
                wait = self.hops.wait(self.scheduler) if share is None else min(share, self.hops.wait(self.scheduler))
                for sock, _ in self.poller.poll(int(self.housekeeping.bound(wait, now) * 1000)):
                    if sock != lock:  # the lock's wake-up is read when the batch runs
                        self._drain(sock)
                if self.hops.ready(self.scheduler):  # never waits for the lock: see HopRunner.ready
                    try:
                        if len(self.scheduler):  # its sessions may have ended while the lock was awaited
                            self._run(self.scheduler.next_batch())
                    finally:
                        self.hops.done()
                        self.idle_trim.worked(time.monotonic())
                self._parked_taps()
                self.share.pump(now := time.monotonic(), self.reply)  # chunks for peers fetching layers, within the cap
                if self.housekeeping.due(now):
                    self._periodic(now)
        finally:
            self.close()

    def _leave_and_drain(self) -> bool:
        """Leave politely: tell the tracker once, then True when the sessions served ended.
        A session unused for PEER_SILENCE has lost its head (a live one steps far more often):
        it does not hold the leave."""
        now = time.monotonic()
        serving = self.kv.active(now, PEER_SILENCE) + len(self.scheduler) + len(self.head or ())
        if self.departure.begin(now, serving):
            self.links.leave()
        return self.departure.over(now, serving)

    def close(self) -> None:
        self.peers.close()
        self.router.close(linger=0)
        self.links.close()
        self.share.close()
        self._lock.close()
        if self.hops.members is not None:
            self.hops.members.close()
        if self.auth is not None:
            self.auth.stop()
        if self._own_ctx:
            self.ctx.term()

    def _drain(self, sock: zmq.Socket) -> None:
        """Read what waits on ``sock``, at most MAX_DRAIN messages (each of a BATCH counts), so work still runs."""
        budget = MAX_DRAIN
        while budget > 0:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            budget -= 1
            if sock is self.router:
                if len(frames) > 2 and frames[2].bytes == TAP_KIND:
                    self._taps.append(frames)  # kept for an audit at most: read after the batch that may be due
                    continue
                budget -= self.inbound(frames[0].bytes, frames[1:]) - 1
            elif sock in self.peers:
                error = self.peers.received(sock, frames)
                if error is not None:
                    self._to_head(error.session, error)
            else:
                self.links.received(sock, frames)

    def _parked_taps(self) -> None:
        """The AUDIT_TAPs ``_drain`` put aside: a pass's taps follow its TOKENs and FORWARDs
        (fabric/node/pass_on.py), and a head reads them after the batch those let it run."""
        taps, self._taps = self._taps, []
        for frames in taps:
            self.inbound(frames[0].bytes, frames[1:])

    def _periodic(self, now: float) -> None:
        self.links.tick(now)
        self.hops.share_cores()
        self.peers.probe(now)
        for session in self.kv.evict_idle():
            self._drop_session(session)  # its KV is gone already: the batch group and gathering forget it too
            log.info("freed idle session %s", session)
        self.scheduler.forget_freed()
        self.idle_trim.tick(now, busy=len(self.scheduler) > 0)
        self.owners.prune(now, lambda: {*self.kv.sessions(), *self.kv.retained.sessions(),
                                        *(w.session for w in self.scheduler.queue)})
        self.asks.keep(self.owners.known)
        self._free_orphans(now)
        for work in self.scheduler.waiting(now):  # hops waiting their turn here: their heads hear they are not lost
            self._progress(work.msg, work.msg.pos)
        if self.head is not None:
            gone, self._gone = self._gone, set()
            self.head.clients_gone(gone)
            self.head.tick(now)
            self._watch_routes(now)
        # links kept however idle: to the heads of sessions here (``_free_orphans``), to the hops of routes headed here
        self.peers.prune(now, lambda: self.owners.heads() | (self.head.watched().keys() if self.head else set()))

    def _watch_routes(self, now: float) -> None:
        """Ping the hops active requests depend on; re-plan around the ones that died."""
        for sock in list(self.peers.endpoint_of):
            self._drain(sock)  # pongs and link events that arrived while this node computed
        dead = self.peers.watch(self.head.watched(), now)
        if dead:
            self.head.lost(dead, now)

    # -- inbound ------------------------------------------------------------------------

    def inbound(self, identity: bytes, frames: list) -> int:
        """Frames a client or peer sent to this node (on the ROUTER or through the relay); each
        message of a BATCH as if it came alone, from the same sender. The messages read."""
        try:
            bodies = p.unbatch(frames)
        except p.ProtocolError as exc:
            self._rejected(identity, exc)
            return 1
        for body in bodies:
            self._inbound(identity, body)
        return len(bodies)

    def _inbound(self, identity: bytes, frames: list) -> None:
        try:
            msg, buffers = p.decode(frames, self.config.max_frame_bytes)
            if isinstance(msg, (p.AuditTap, p.AuditResult)):  # whose it is: the transport says, not the frame
                self._audit_answer(msg, buffers, self._sender(frames))
                return
            self._dispatch(identity, msg, buffers)
        except p.ProtocolError as exc:
            self._rejected(identity, exc)
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("failed handling a frame")
            self.reply(identity, p.Error(p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",
                                         node=self.config.node_id))

    def _dispatch(self, identity: bytes, msg: p.Message, buffers: list) -> None:
        match msg:
            case p.Forward():
                try:
                    self._accept_forward(identity, msg, from_wire(msg.tensors[0], buffers[0]))
                except p.ProtocolError as exc:
                    self._refuse_forward(identity, msg, exc)
            case p.Token() | p.Progress() | p.CacheMiss():
                self._to_head(msg.session, msg)
            case p.Error(session=str() as session):
                self._to_head(session, msg)
            case p.Generate() if self.departure.leaving:
                self.reply(identity, self.departure.refusal())
            case p.Generate() if self.head is not None:
                self.head.generate(identity, msg)
            case p.Generate():
                raise p.ProtocolError("this node is not the head of that route", p.ErrorCode.BAD_REQUEST)
            case p.Cancel() | p.Close():
                self._end(identity, msg)
            case p.Audit() if not self.scheduler.push_replay(Replay(msg, from_wire(msg.tensors[0], buffers[0]))):
                self._send(msg.reply_to, msg.reply_key, p.AuditResult(msg.audit, error="busy: audits queued here"))
            case p.Audit():
                pass  # queued: it runs between hops (_run)
            case p.AuditTap() | p.AuditResult():  # sent by this very node to itself (``_send``)
                self._audit_answer(msg, buffers, self.key)
            case p.ManifestRequest():
                self.reply(identity, *self.share.manifest_answer(msg))
            case p.ChunkRequest():
                self.reply(identity, self.share.request(identity, msg))  # None: queued, ``pump`` sends it
            case p.Ping():
                self.reply(identity, p.Pong(msg.nonce, node=self.config.node_id, sessions=len(self.kv)))
            case p.Error() | p.Pong() | p.Ack():
                log.debug("ignoring %s", type(msg).__name__)
            case _:
                raise p.ProtocolError(f"a node does not accept {type(msg).__name__}", p.ErrorCode.BAD_REQUEST)

    def _audit_answer(self, msg: p.AuditTap | p.AuditResult, buffers: list, sender: str) -> None:
        """A hop's tap or a replica's result: the head's auditor decides whether it asked for it."""
        if self.head is not None:
            self.head.auditor.received(msg, [from_wire(s, b) for s, b in zip(msg.tensors, buffers)], sender)

    def _to_head(self, session: str, msg: p.Token | p.Progress | p.CacheMiss | p.Error) -> None:
        if self.head is not None:
            self.head.deliver(session, msg)

    # -- outbound (the Transport of RouteSession, the host of Head and Links) -----------

    def forward(self, hop: p.Hop, message: p.Forward, tensor: torch.Tensor) -> None:
        if hop.endpoint == self.endpoint:
            if message.pos == 0 or message.reuse:
                self.owners.open(message.session, SELF, head=self.endpoint)
            self.scheduler.push(Work(message, tensor))
            return
        if message.wire_dtype and tensor.is_floating_point():
            tensor = tensor.to(TORCH_DTYPES[message.wire_dtype])  # validated against WIRE_DTYPES
        self.send_tensors(hop.endpoint, hop.key, message, [tensor])

    def send_tensors(self, endpoint: str, key: str, message: p.Message, tensors: list[torch.Tensor]) -> None:
        """Send ``message`` with ``tensors`` as its buffers (an audit's input and outputs)."""
        wired = [to_wire(t) for t in tensors]
        frames = p.encode(dataclasses.replace(message, tensors=tuple(s for s, _ in wired)), [b for _, b in wired])
        if endpoint == self.endpoint:
            self.inbound(b"", frames)
        else:
            self.peers.send(endpoint, key, frames, copy=False)

    def control(self, hop: p.Hop, message: p.Cancel | p.Close) -> None:
        if hop.endpoint == self.endpoint:
            self._free(message)
        else:
            self._send(hop.endpoint, hop.key, message)

    def _progress(self, msg: p.Forward, done: int) -> None:
        """Tell the head of ``msg``'s session that its step moves (or waits its turn) here."""
        self._send(msg.reply_to, msg.reply_key, p.Progress(msg.session, msg.step, self.config.node_id, msg.end_layer,
                                                           done))

    def _send(self, endpoint: str, key: str, message: p.Message) -> None:
        if endpoint == self.endpoint:
            self._dispatch(b"", message, [])
        else:
            self.peers.send(endpoint, key, p.encode(message))

    def to_tracker(self, message: p.Message) -> bool:
        return self.links.send(message)

    def route_answer(self, msg: p.Route | p.Error) -> None:
        if self.head is not None:
            self.head.route_answer(msg)

    def replicas(self, msg: p.Replicas) -> None:
        if self.head is not None:
            self.head.auditor.replicas(msg)

    def probe(self, peers: dict[str, str]) -> None:
        self.peers.probes = peers

    def registration(self) -> p.Register:
        relay, w = self.links.relay, self.executor.w
        return telemetry.registration(telemetry.Identity(
            self.config, self.endpoint, self.fingerprint, self.benchmark, w.dtype, w.parameter_bytes(),
            relay.relay if relay else "", relay.front_key if relay else ""))

    def heartbeat(self) -> p.Heartbeat:
        return telemetry.heartbeat(self.current_load(), self.peers.rtt.snapshot(time.monotonic()))

    def metrics(self) -> list[Sample]:
        """Live numbers for /metrics; safe to call from another thread."""
        return telemetry.metrics(self.current_load())

    def current_load(self) -> telemetry.Load:
        """How busy this node is now, copied (so safe to take from another thread)."""
        kept = self.kv.retained
        return telemetry.Load(self.config.node_id, len(self.kv), self.kv.nbytes(), len(self.head or ()),
                              len(self.scheduler), self.counters.copy(), kept.bytes, kept.budget, len(kept),
                              kept.stats.copy(), self.head.routes.view() if self.head is not None else {})


def bound_router(ctx: zmq.Context, config: NodeConfig) -> zmq.Socket:
    """A node's ROUTER, bound to ``--bind``."""
    router = ctx.socket(zmq.ROUTER)
    serve_securely(router, config.security)
    router.setsockopt(zmq.LINGER, 0)
    # a reply to a connection that closed fails (EHOSTUNREACH) instead of vanishing: that
    # client is gone, and the requests it opened stop (``_periodic``)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    # The kernel closes a connection whose far end went silent without closing it: keepalive
    # probes when it is idle, and TCP_USER_TIMEOUT (ZMQ_TCP_MAXRT) when what this node sent stays
    # unacknowledged (a client's machine gone mid-stream). Not ZeroMQ's own heartbeat
    # (ZMQ_HEARTBEAT_IVL): in libzmq 4.3.5 its timer writes to a connection that closed while its
    # input was stopped (a peer filled this socket's queue, then left), and the assertion
    # !_io_error aborts the process. Any peer could crash a node so
    # (tests/adversary/test_flood_stop.py).
    router.setsockopt(zmq.TCP_MAXRT, int(PEER_SILENCE * 1000))
    router.setsockopt(zmq.TCP_KEEPALIVE, 1)
    router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    router.bind(config.bind)
    return router


def draft_model(c: NodeConfig, tokenizer, vocab: int) -> DraftModel | None:
    """The head's draft model ``--draft`` names, if any (ModelError: its vocabulary is not the model's)."""
    if c.draft is None or not c.head.speculation.enabled:
        return None
    return DraftModel.load(c.draft, tokenizer, vocab, dtype=c.draft_dtype or c.dtype, device=c.device,
                           quant=c.draft_quant, cache_root=c.cache_root, progress=c.progress)


def tail_grammars(config: NodeConfig, vocab: int, model_config) -> Grammars:
    """The tail's grammar compiler; it loads the tokenizer only when a session first asks."""
    return Grammars(lambda: load_tokenizer(config.source, config.cache_root), vocab,
                    lambda tokenizer: sorted(eos_ids(tokenizer, model_config)))
