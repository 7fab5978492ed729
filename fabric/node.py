"""The node daemon: poll sockets, decode frames, execute hops, forward, heartbeat.

One thread owns every socket and the model. Inbound frames arrive on a ROUTER; frames to
peers leave through one DEALER per peer endpoint. Work (a hop to execute) is queued and
run between polls, so a node keeps answering while it computes for many sessions. When
this node is the head of a request, its RouteSession sends the first hop to this very
node: such frames are queued in-process instead of crossing a socket.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq
import zmq.utils.monitor

from . import protocol as p
from .compute_lock import ComputeLock
from .executor import CacheMissError, ShardExecutor, Step, StepResult
from .kv import KVStore
from .liveness import PeerLiveness, RttTable, splice
from .models import ModelSource, fingerprint, load_shard, load_tokenizer
from .route_session import RequestError, RouteSession, encode_prompt, eos_ids
from .sampling import sample
from .metrics import Sample
from .relay import RelayedPeer, RelayLink
from .security import Security, SecurityError, dial_securely, serve_securely, start_authenticator
from .shard import Shard
from .tensors import TORCH_DTYPES, from_wire, to_wire
from .tracker_link import TrackerLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    source: ModelSource  # what to load
    shard: Shard  # which layers this node holds
    bind: str = "tcp://127.0.0.1:0"  # ROUTER address; port 0 picks a free port
    advertise: str | None = None  # endpoint peers should dial; defaults to the bound one
    tracker: str | None = "tcp://127.0.0.1:5555"  # None: run without a tracker (tests, scripts)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    quant: str | None = None  # "int8" / "int4": weight-only quantized shard (bfloat16 compute, CPU)
    node_id: str = field(default_factory=lambda: "node-" + secrets.token_hex(4))
    heartbeat_interval: float = 1.0  # seconds between heartbeats to the tracker
    ping_interval: float = 0.25  # the head pings the hops of its active routes this often
    peer_silence: float = 10.0  # a hop that answers nothing this long is dead (hung, unreachable)
    link_grace: float = 0.25  # a hop whose TCP link stays down this long is dead (its process died)
    hop_timeout: float = 30.0  # the head re-prefills a step that got no reply for this long
    progress_interval: float = 0.5  # seconds between progress reports of a request this node heads
    kv_idle_timeout: float = 300.0  # free a session's KV after this long unused
    max_sessions: int = 64  # concurrent sessions this node keeps KV for
    max_batch: int = 16  # decode steps of different sessions run as one forward pass
    max_prompt_tokens: int = 4096  # the head refuses longer prompts
    prefill_slice: float = 0.0  # seconds of prefill run between decode batches while streams decode; 0: auto
    wire_dtype: str = ""  # hidden states on the wire of routes this node heads ("": compute dtype)
    compute_lock: str | None = None  # a file nodes sharing this machine lock while they compute (one at a time)
    max_frame_bytes: int = 64 << 20  # largest tensor buffer accepted from a peer
    cache_root: Path | None = None  # where parsed GGUF metadata is cached
    progress: bool = True  # show a progress bar while weights load
    security: Security | None = None  # CurveZMQ keys and allow-list; None: plaintext (a trusted LAN)
    relay: str | None = None  # a relay's control endpoint: peers reach this node through the relay's front
    relay_fallback: str | None = None  # a relay to switch to if the tracker cannot reach the advertised endpoint
    relay_key: str = ""  # the relay's CURVE public key (secured swarms); "": the tracker's key
    relay_interval: float = 1.0  # seconds between keepalives (RELAY_OPEN) to the relay
    relay_timeout: float = 3.0  # a relay silent this long is dialled again (and heartbeats pause)
    probe_interval: float = 2.0  # seconds between round-trip probes of peers outside active routes


def stable_node_id(data_root: Path, model_id: str, shard: Shard, bind: str) -> str:
    """A node id made once per (model, layers, bind address) and kept in a key file. A node
    bound to port 0 (any free port) has no stable address, so it gets a fresh id."""
    import hashlib

    if bind.rstrip("/").endswith((":0", ":*")):
        return "node-" + secrets.token_hex(4)

    slot = hashlib.sha256(f"{model_id}|{shard}|{bind}".encode()).hexdigest()[:16]
    path = data_root / "node-ids" / slot
    if path.is_file():
        return path.read_text().strip()
    node_id = "node-" + secrets.token_hex(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_id + "\n")
    return node_id


FIRST_SLICE_TOKENS = 32  # prefill tokens per slice before this node has timed any
MIN_SLICE_TOKENS = 8  # a slice's fixed cost (reading the weights) dwarfs this many tokens' own
MAX_SLICE_TOKENS = 4096
WHOLE_PREFILL_TOKENS = 64  # a prefill this short runs whole: sliced, each piece would cost nearly as much
PREFILL_BATCH_TOKENS = 256  # short prompts queued together run as one forward pass of at most this many tokens
SLICE_PER_DECODE = 1.0  # a prefill slice beside decoding streams may take this many of their decode batches
MIN_SLICE_S = 0.02  # ...and at least this long
IDLE_SLICE_S = 0.25  # ...and with no stream decoding here, this long
GATHER_PER_DECODE = 1.0  # a decode batch waits at most this many decode batches' time for sessions still due
RECENT_CYCLES = 3.0  # a session is due here while its last decode step is this many of its cycles old
SLOW_HOP_S = 5.0  # a hop this long is logged: it stalls every session queued behind it
LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
COUNTERS = ("hop_seconds", "hops", "batched_hops", "prefill_chunks", "cache_miss", "failovers", "rejected_frames",
            "dropped_frames", "hop_errors")


@dataclass
class Work:
    """A hop to execute: a FORWARD and its input tensor (already validated)."""

    msg: p.Forward
    tensor: torch.Tensor


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else old + weight * (new - old)


class Node:
    def __init__(self, config: NodeConfig, ctx: zmq.Context | None = None):
        self.config = config
        # a secured node owns its context: one ZAP handler per context
        self._own_ctx = ctx is None and config.security is not None
        self.ctx = ctx or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        weights = load_shard(config.source, config.shard, dtype=config.dtype, device=config.device,
                             progress=config.progress, cache_root=config.cache_root, quant=config.quant)
        self.kv = KVStore(config.kv_idle_timeout)
        self.executor = ShardExecutor(weights, self.kv)
        self.tokenizer = load_tokenizer(config.source, config.cache_root) if config.shard.is_first else None
        self.eos = eos_ids(self.tokenizer, weights.config) if self.tokenizer else frozenset()
        self.fingerprint = fingerprint(config.source, weights.config, config.quant)
        self.auth = start_authenticator(self.ctx, config.security) if config.security else None
        self.key = config.security.public_text if config.security else ""  # peers dial us with it
        self.router = self.ctx.socket(zmq.ROUTER)
        serve_securely(self.router, config.security)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.bind(config.bind)
        self.endpoint = config.advertise or self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.peers: dict[str, zmq.Socket] = {}
        self.peer_of: dict[zmq.Socket, str] = {}  # DEALER -> the endpoint it dials
        self.poller = zmq.Poller()
        self.liveness = PeerLiveness(config.ping_interval, config.peer_silence, config.link_grace)
        self.rtt = RttTable()  # round trips to peers, reported in heartbeats for the planner
        self.probes: dict[str, str] = {}  # endpoint -> key of peers the tracker asked us to measure
        self._next_probe = 0.0
        self.relay: RelayLink | None = None  # the link to our relay, when peers cannot dial us
        self._warned_unreachable = False
        self.monitor_of: dict[zmq.Socket, str] = {}  # socket monitor -> the peer endpoint it watches
        self.pending_routes: deque[str] = deque()  # sessions awaiting a failover route, in request order
        self.tracker: zmq.Socket | None = None
        self.link: TrackerLink | None = None  # the DEALER to the tracker and what its silence means
        self.work: deque[Work] = deque()
        self.sessions: dict[str, RouteSession] = {}  # requests this node heads
        self.clients: dict[str, bytes] = {}  # request id -> client identity on the ROUTER
        # hops, cache misses, failovers, errors: for /metrics and tests. Every key exists from
        # the start, so another thread can copy the counter while this one updates it.
        self.counters: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self._compute_lock = ComputeLock(config.compute_lock)
        self.benchmark = self._benchmark()
        self.ready = threading.Event()
        self._next_heartbeat = 0.0
        self._ran_prefill = False  # the last hop run was a prefill (chunk): a decode batch goes next
        self._decode_batch_s: float | None = None  # seconds per decode batch here (moving average)
        self._last_decode: dict[str, float] = {}  # session -> when its last decode step ran here
        self._cycle_s: float | None = None  # seconds between a session's decode steps here (moving average)
        self._gather_since: float | None = None  # when a decode batch began waiting for sessions still due
        # prefill tokens per slice, steered so a slice takes its target time (beside streams / alone)
        self._slice_tokens = {"busy": float(FIRST_SLICE_TOKENS), "idle": float(FIRST_SLICE_TOKENS)}

    # -- main loop ----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.poller.register(self.router, zmq.POLLIN)
        if self.config.relay:
            self._open_relay(stop)
        if self.config.tracker:
            self.link = TrackerLink(self.ctx, self.config.tracker, self.config.security)
            self.tracker = self.link.sock
            self.poller.register(self.tracker, zmq.POLLIN)
            self.poller.register(self.link.monitor, zmq.POLLIN)
            self._register()
        log.info("node %s serving layers %s of %s at %s", self.config.node_id, self.config.shard,
                 self.config.source.model_id, self.endpoint)
        self.ready.set()
        try:
            while not stop.is_set():
                wait = self._gather_wait(time.monotonic()) if self.work else 0.05
                for sock, _ in self.poller.poll(int(wait * 1000)):
                    self._drain(sock)
                if self.work and self._gather_wait(time.monotonic()) == 0:
                    self._run_next()
                self._periodic()
        finally:
            self.close()

    def close(self) -> None:
        for sock in self.peer_of:
            # first stop each link monitor: an event for a monitor whose reader is gone blocks
            # the context's I/O thread, and with it every socket of this process
            sock.disable_monitor()
        for sock in [*self.monitor_of, self.router, *self.peers.values()]:
            sock.close(linger=0)
        if self.link is not None:
            self.link.close()
        if self.relay is not None:
            self.relay.close()
        self._compute_lock.close()
        self.monitor_of.clear()
        self.peers.clear()
        self.peer_of.clear()
        if self.auth is not None:
            self.auth.stop()
        if self._own_ctx:
            self.ctx.term()

    def _drain(self, sock: zmq.Socket) -> None:
        """Read every frame waiting on ``sock`` (bounded, so work still runs)."""
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if sock is self.router:
                self._inbound(frames[0].bytes, frames[1:])
            elif sock is self.tracker:
                self._tracker_reply(frames)
            elif self.link is not None and sock is self.link.monitor:
                self.link.on_monitor(frames)
            elif sock in self.monitor_of:
                self._link_event(self.monitor_of[sock], frames)
            elif self.relay is not None and sock is self.relay.sock:
                self._relay_frames(frames)
            else:
                self._peer_reply(self.peer_of[sock], frames)

    def _periodic(self) -> None:
        now = time.monotonic()
        if self.tracker is not None and now >= self._next_heartbeat and self._reachable():
            self._next_heartbeat = now + self.config.heartbeat_interval
            self._to_tracker(p.Heartbeat(self.config.node_id, sessions=len(self.kv), queued=len(self.work),
                                         rtts=self.rtt.snapshot(now)))
        if self.link is not None:
            self.link.check(now)
        self._relay_tick(now)
        self._probe_peers(now)
        for session in self.kv.evict_idle():
            self._drop_session(session)  # its KV is gone already: the batch group and gathering forget it too
            log.info("freed idle session %s", session)
        if len(self._last_decode) > len(self.kv):
            self._last_decode = {s: t for s, t in self._last_decode.items() if s in self.kv}
        for rs in list(self.sessions.values()):
            self._emit(rs, rs.check_timeout(now, self.config.hop_timeout))
        self._watch_routes(now)

    # -- inbound ------------------------------------------------------------------------

    def _inbound(self, identity: bytes, frames: list) -> None:
        try:
            msg, buffers = p.decode(frames, self.config.max_frame_bytes)
            self._dispatch(identity, msg, buffers)
        except p.ProtocolError as exc:
            self.counters["rejected_frames"] += 1
            log.warning("rejected frame from %r: %s", identity, exc)
            self._reply(identity, p.Error(exc.code, str(exc), node=self.config.node_id))
        except Exception as exc:  # a bug must cost one request, never the node
            log.exception("failed handling a frame")
            self._reply(identity, p.Error(p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}",
                                          node=self.config.node_id))

    def _dispatch(self, identity: bytes, msg: p.Message, buffers: list) -> None:
        match msg:
            case p.Forward():
                self._accept_forward(msg, from_wire(msg.tensors[0], buffers[0]))
            case p.Token() | p.CacheMiss():
                self._to_session(msg.session, msg)
            case p.Error(session=str() as session):
                self._to_session(session, msg)
            case p.Generate():
                self._generate(identity, msg)
            case p.Cancel() | p.Close():
                self._end_session(msg)
            case p.Ping():
                self._reply(identity, p.Pong(msg.nonce, node=self.config.node_id, sessions=len(self.kv)))
            case p.Error() | p.Pong() | p.Ack():
                log.debug("ignoring %s", type(msg).__name__)
            case _:
                raise p.ProtocolError(f"a node does not accept {type(msg).__name__}", p.ErrorCode.BAD_REQUEST)

    def _accept_forward(self, msg: p.Forward, tensor: torch.Tensor) -> None:
        if not self.config.shard.covers(msg.start_layer, msg.end_layer):
            raise p.ProtocolError(f"layers {msg.start_layer}-{msg.end_layer} are not on this node "
                                  f"(it holds {self.config.shard})", p.ErrorCode.BAD_REQUEST)
        if msg.end_layer != self.config.shard.num_layers - 1 and not msg.route:
            raise p.ProtocolError(f"layers end at {msg.end_layer} but no hop follows", p.ErrorCode.BAD_REQUEST)
        if msg.route and msg.route[-1].end_layer != self.config.shard.num_layers - 1:
            raise p.ProtocolError("the route does not reach the last layer", p.ErrorCode.BAD_REQUEST)
        if msg.start_layer > 0 and tensor.shape[-1] != self.executor.hidden_size:
            raise p.ProtocolError(f"hidden size {tensor.shape[-1]} != {self.executor.hidden_size}")
        if msg.pos == 0 and msg.session not in self.kv and len(self.kv) >= self.config.max_sessions:
            self._send(msg.reply_to, msg.reply_key, p.Error(p.ErrorCode.BUSY, "node is at its session limit",
                                             session=msg.session, step=msg.step, node=self.config.node_id))
            return
        self.work.append(Work(msg, tensor))

    def _to_session(self, session: str, msg: p.Message) -> None:
        rs = self.sessions.get(session)
        if rs is None:
            return  # a late reply for a request that already ended
        match msg:
            case p.Token():
                events = rs.on_token(msg)
            case p.CacheMiss():
                events = rs.on_cache_miss(msg)
            case _:
                events = rs.on_error(msg)
        self._emit(rs, events)

    # -- executing hops -----------------------------------------------------------------

    def _gather_wait(self, now: float) -> float:
        """Seconds the queued work should still wait for sessions due here (0: run now).

        Sessions reach a node out of step (prompts start at different times), and a node
        that runs each as it comes keeps them out of step: it runs batches of one, each
        costing nearly a whole batch's time. So a decode batch waits, at most
        GATHER_PER_DECODE of a batch's time, for the sessions that decoded here within their
        last few cycles; the waiting pulls them into step, after which they arrive together
        and nothing waits. A queued prefill does not wait: it runs in the meantime. Except
        under a compute lock, after a prefill slice: another slice now would hold the lock
        while the other nodes of the machine have those sessions' decode steps to run, so
        the node waits (at most one of their cycles) for them to come back first."""
        decode_only = all(self._decode_step(w) for w in self.work)
        yield_to_decode = self._ran_prefill and self._compute_lock.shared
        if not (decode_only or yield_to_decode):
            self._gather_since = None
            return 0.0
        queued = {w.msg.session for w in self.work}
        horizon = RECENT_CYCLES * (self._cycle_s or 0.0)
        due = [s for s, t in self._last_decode.items() if s not in queued and now - t < horizon and s in self.kv]
        if not due or len(queued) >= self.config.max_batch:
            self._gather_since = None
            return 0.0
        if self._gather_since is None:
            self._gather_since = now
        limit = GATHER_PER_DECODE * (self._decode_batch_s or 0.0) if decode_only else (self._cycle_s or 0.0)
        left = self._gather_since + limit - now
        if left <= 0:
            self._gather_since = None
            return 0.0
        return left

    def _run_next(self) -> None:
        """Run the next queued hop, batched with the other queued hops of its kind over the
        same layers (one forward pass for many sessions): decode steps, or short whole
        prompts. Prefill chunks and decode batches take turns, so a long prompt never
        stalls the streams already decoding by more than one chunk, and the prompt still
        moves on while they decode."""
        first = self._take(decode=self._ran_prefill)
        self._ran_prefill = not self._decode_step(first)
        if self._ran_prefill:
            first = self._slice(first)
        span = (first.msg.start_layer, first.msg.end_layer)
        if self._decode_step(first):
            kind = self._decode_step
        elif self._short_prompt(first):
            kind = self._short_prompt
        else:
            kind = None
        if kind is None or not self.executor.batchable(*span):
            self._execute([first])
            return
        batch, rest, tokens = [first], deque(), first.tensor.shape[1]
        sessions = {first.msg.session}
        waiting: set[str] = set()  # sessions with a hop left behind: their later hops wait too
        while self.work:
            w = self.work.popleft()
            same = (w.msg.start_layer, w.msg.end_layer) == span and w.msg.session not in sessions | waiting
            fits = len(batch) < self.config.max_batch and (
                kind is self._decode_step or tokens + w.tensor.shape[1] <= PREFILL_BATCH_TOKENS)
            if same and kind(w) and fits:
                batch.append(w)
                sessions.add(w.msg.session)
                tokens += w.tensor.shape[1]
            else:
                rest.append(w)
                waiting.add(w.msg.session)
        self.work = rest
        self._execute(batch)

    @staticmethod
    def _short_prompt(work: Work) -> bool:
        """A whole prompt short enough to run unsliced (and so with other such prompts)."""
        return work.msg.pos == 0 and not work.msg.more and work.tensor.shape[1] < WHOLE_PREFILL_TOKENS

    def _slice(self, work: Work) -> Work:
        """Cut a long prefill into the slice to run now and the rest, queued first. While
        other sessions decode here a slice costs about SLICE_PER_DECODE of their decode
        batches, so they wait one slice, not the whole prompt; alone, slices of IDLE_SLICE_S keep this loop
        answering pings and heartbeats. The rest goes on as further chunks (``more``)."""
        q, msg = work.tensor.shape[1], work.msg
        n = int(self._slice_tokens[self._slice_mode(msg.session)])
        if q < max(2 * n, WHOLE_PREFILL_TOKENS):
            return work  # the rest would be a slice too small to pay its fixed cost
        self.work.appendleft(Work(dataclasses.replace(msg, pos=msg.pos + n), work.tensor[:, n:]))
        return Work(dataclasses.replace(msg, more=True), work.tensor[:, :n])

    def _slice_mode(self, session: str) -> str:
        others = len(self.kv) - (session in self.kv) > 0 or any(self._decode_step(w) for w in self.work)
        return "busy" if others else "idle"

    def _steer_slices(self, work: Work, elapsed: float) -> None:
        """After a full prefill slice, size the next toward its target time. A slice costs
        a fixed part (the weights are read once) plus a part per token, so the size is
        corrected by the ratio of target to measured time, at most 2x per step."""
        mode = self._slice_mode(work.msg.session)
        q, n = work.tensor.shape[1], self._slice_tokens[mode]
        if q < int(n):
            return  # a whole short prompt or a remainder says little about a slice's cost
        target = IDLE_SLICE_S if mode == "idle" else (
            self.config.prefill_slice or max(MIN_SLICE_S, SLICE_PER_DECODE * (self._decode_batch_s or 0.0)))
        size = q * min(2.0, max(0.5, target / elapsed))
        self._slice_tokens[mode] = min(MAX_SLICE_TOKENS, max(MIN_SLICE_TOKENS, size))

    def _take(self, decode: bool) -> Work:
        """Remove and return the first queued hop of the wanted kind whose session has
        nothing queued before it (a session's hops run in order), else the first hop."""
        earlier: set[str] = set()
        for i, w in enumerate(self.work):
            if self._decode_step(w) == decode and w.msg.session not in earlier:
                del self.work[i]
                return w
            earlier.add(w.msg.session)
        return self.work.popleft()

    @staticmethod
    def _decode_step(work: Work) -> bool:
        return work.tensor.shape[1] == 1 and work.msg.pos > 0 and not work.msg.more

    def _execute(self, batch: list[Work]) -> None:
        """Run hops (one, or a batch of decode steps or of short prompts); a failure costs
        those sessions only, never the node."""
        with self._compute_lock:
            started = time.perf_counter()
            try:
                steps = [Step(w.msg.session, w.msg.start_layer, w.msg.end_layer, w.tensor, w.msg.pos) for w in batch]
                if len(batch) == 1:
                    results = [self._run_one(batch[0])]
                elif self._decode_step(batch[0]):
                    results = self.executor.run_batch(steps)
                else:
                    results = self.executor.run_prefills(steps)
                self.executor.finish()
            except Exception as exc:
                log.exception("hop failed for sessions %s", [w.msg.session for w in batch])
                results = [exc] * len(batch)
        self.counters["hops"] += len(batch)
        self.counters["batched_hops"] += len(batch) if len(batch) > 1 else 0
        self.counters["prefill_chunks"] += batch[0].msg.more
        elapsed = time.perf_counter() - started
        self.counters["hop_seconds"] += elapsed
        if elapsed > SLOW_HOP_S:
            log.warning("a hop of %d session(s) took %.1f s (layers %d-%d, %d tokens at position %d)", len(batch),
                        elapsed, batch[0].msg.start_layer, batch[0].msg.end_layer, batch[0].tensor.shape[1],
                        batch[0].msg.pos)
        if self._decode_step(batch[0]):
            self._decode_batch_s = _average(self._decode_batch_s, elapsed)
            for work in batch:
                last = self._last_decode.get(work.msg.session)
                if last is not None:
                    self._cycle_s = _average(self._cycle_s, started - last)
                self._last_decode[work.msg.session] = started
        elif len(batch) == 1:  # a batch of prompts says nothing about one slice's cost
            self._steer_slices(batch[0], elapsed)
        for work, result in zip(batch, results):
            try:
                self._after_hop(work, result)
            except Exception as exc:
                log.exception("could not pass on session %s", work.msg.session)
                self._after_hop(work, exc)

    def _run_one(self, work: Work) -> StepResult | Exception:
        msg = work.msg
        try:
            return self.executor.run(msg.session, msg.start_layer, msg.end_layer, work.tensor, msg.pos,
                                     logits=not msg.more)
        except Exception as exc:  # CacheMissError included: handled per session below
            return exc

    def _after_hop(self, work: Work, result: StepResult | Exception) -> None:
        """Send what a hop produced: the next FORWARD, the tail's TOKEN, or a failure."""
        msg = work.msg
        if msg.more and msg.session in self.sessions:
            self.sessions[msg.session].progressed(time.monotonic())
        if isinstance(result, CacheMissError):
            self.counters["cache_miss"] += 1
            self._send(msg.reply_to, msg.reply_key, p.CacheMiss(msg.session, msg.step, self.config.node_id,
                                                                 result.have))
        elif isinstance(result, Exception):
            self.counters["hop_errors"] += 1
            self._drop_session(msg.session)
            self._send(msg.reply_to, msg.reply_key, p.Error(
                p.ErrorCode.INTERNAL, f"{type(result).__name__}: {result}", session=msg.session,
                step=msg.step, node=self.config.node_id))
        elif result.logits is None and not msg.route:
            return  # the tail filled its KV with a prefill chunk that more chunks follow
        elif result.logits is not None:
            pos = msg.pos + work.tensor.shape[1]
            token = sample(result.logits, msg.sampling, pos)
            self._send(msg.reply_to, msg.reply_key, p.Token(msg.session, msg.step, token, pos))
        else:
            nxt = msg.route[0]
            out = dataclasses.replace(msg, start_layer=nxt.start_layer, end_layer=nxt.end_layer, route=msg.route[1:],
                                      tensors=())
            self._forward(nxt, out, result.hidden)

    # -- requests this node heads -------------------------------------------------------

    def _generate(self, identity: bytes, req: p.Generate) -> None:
        if self.tokenizer is None or req.route[0].endpoint != self.endpoint:
            raise p.ProtocolError("this node is not the head of that route", p.ErrorCode.BAD_REQUEST)
        if req.request_id in self.sessions:
            raise p.ProtocolError("request id already in flight", p.ErrorCode.BAD_REQUEST)
        if req.route[-1].end_layer != self.config.shard.num_layers - 1:
            raise p.ProtocolError(f"the route ends at layer {req.route[-1].end_layer}, not at the last layer "
                                  f"{self.config.shard.num_layers - 1}", p.ErrorCode.BAD_REQUEST)
        try:
            prompt = encode_prompt(self.tokenizer, req, self.config.max_prompt_tokens)
        except RequestError as exc:
            self._reply(identity, p.Event(req.request_id, "error", text=str(exc), error_code=exc.code,
                                          finish_reason="error"))
            return
        rs = RouteSession(req, prompt, tokenizer=self.tokenizer, eos=self.eos, reply_to=self.endpoint,
                          reply_key=self.key, transport=self, seed=secrets.randbits(62),
                          wire_dtype=self.config.wire_dtype)
        self.sessions[req.request_id] = rs
        self.clients[req.request_id] = identity
        self._emit(rs, rs.start())

    def _end_session(self, msg: p.Cancel | p.Close) -> None:
        rs = self.sessions.get(msg.session)
        if rs is not None and isinstance(msg, p.Cancel):
            self._emit(rs, rs.cancel())  # the client cancelled a request this node heads
        else:
            self._free(msg)

    def _free(self, msg: p.Cancel | p.Close) -> None:
        """Drop the session's KV and queued work here, then pass the message down the route."""
        self._drop_session(msg.session)
        self.work = deque(w for w in self.work if w.msg.session != msg.session)
        if msg.route:
            nxt = msg.route[0]
            self._send(nxt.endpoint, nxt.key, type(msg)(session=msg.session, route=msg.route[1:]))

    def _drop_session(self, session: str) -> None:
        """Forget ``session``'s KV here, also as a row of the executor's batch group."""
        self.kv.drop(session)
        self.executor.forget(session)
        self._last_decode.pop(session, None)

    def _emit(self, rs: RouteSession, events: list[p.Event]) -> None:
        identity = self.clients.get(rs.session)
        for event in events:
            if identity is not None:
                self._reply(identity, event)
        if rs.finished:
            self.sessions.pop(rs.session, None)
            self.clients.pop(rs.session, None)
            self._report(rs)
        elif time.monotonic() - rs.reported_at >= self.config.progress_interval:
            self._report(rs)  # progress for every request, streamed or not

    def _report(self, rs: RouteSession) -> None:
        rs.reported_at = time.monotonic()
        if self.tracker is None:
            return
        self._to_tracker(p.Report(
            request_id=rs.session, node_id=self.config.node_id, model=self.config.source.model_id,
            route=rs.route, prompt_tokens=rs.prompt_tokens, completion_tokens=len(rs.generated),
            elapsed=rs.elapsed, final=rs.finished is not None, finish_reason=rs.finished, api_key=rs.request.api_key,
            max_tokens=rs.request.max_tokens))

    # -- Transport (used by RouteSession) -----------------------------------------------

    def forward(self, hop: p.Hop, message: p.Forward, tensor: torch.Tensor) -> None:
        self._forward(hop, message, tensor)

    def control(self, hop: p.Hop, message: p.Cancel | p.Close) -> None:
        if hop.endpoint == self.endpoint:
            self._free(message)
        else:
            self._send(hop.endpoint, hop.key, message)

    # -- outbound -----------------------------------------------------------------------

    def _forward(self, hop: p.Hop, message: p.Forward, tensor: torch.Tensor) -> None:
        if hop.endpoint == self.endpoint:
            self.work.append(Work(message, tensor))
            return
        if message.wire_dtype and tensor.is_floating_point():
            tensor = tensor.to(TORCH_DTYPES[message.wire_dtype])  # validated against WIRE_DTYPES
        spec, buf = to_wire(tensor)
        self._to_peer(hop.endpoint, hop.key, p.encode(dataclasses.replace(message, tensors=(spec,)), [buf]),
                      copy=False)

    def _send(self, endpoint: str, key: str, message: p.Message) -> None:
        if endpoint == self.endpoint:
            self._dispatch(b"", message, [])
        else:
            self._to_peer(endpoint, key, p.encode(message))

    def _to_peer(self, endpoint: str, key: str, frames: list, copy: bool = True) -> None:
        """Send to a peer without ever blocking the loop: a full or bad peer loses the frame
        (the head's timeout re-sends the step), not the node."""
        try:
            self._peer(endpoint, key).send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self.counters["dropped_frames"] += 1
            log.warning("peer %s is not draining its queue; dropped a frame", endpoint)
        except (zmq.ZMQError, SecurityError) as exc:
            self.counters["dropped_frames"] += 1
            log.warning("cannot send to %r: %s", endpoint, exc)

    def _reply(self, identity: bytes, message: p.Message) -> None:
        if isinstance(identity, RelayedPeer):  # the peer reached us through our relay's front
            self.relay.send(identity, p.encode(message))
        elif identity:
            try:
                self.router.send_multipart([identity, *p.encode(message)], flags=zmq.NOBLOCK)
            except zmq.Again:
                log.warning("client %r is not reading; dropped an event", identity)

    def _peer(self, endpoint: str, key: str) -> zmq.Socket:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = self.peers[endpoint] = self._dealer(endpoint, key)
            self.peer_of[sock] = endpoint
            self.poller.register(sock, zmq.POLLIN)  # pongs and errors come back on it
            monitor = sock.get_monitor_socket(LINK_EVENTS)  # its link going down = the peer died
            self.monitor_of[monitor] = endpoint
            self.poller.register(monitor, zmq.POLLIN)
        return sock

    def _dealer(self, endpoint: str, key: str | bytes | None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10000)
        try:
            dial_securely(sock, self.config.security, key)
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> list[Sample]:
        """Live numbers for /metrics; safe to call from another thread."""
        c, labels = self.counters.copy(), {"node": self.config.node_id}
        rows = [Sample("node_sessions", "sessions holding KV on this node", len(self.kv), labels=labels),
                Sample("node_kv_bytes", "bytes of KV cache held", self.kv.nbytes(), labels=labels),
                Sample("node_requests_in_flight", "requests this node heads", len(self.sessions), labels=labels),
                Sample("node_queued_hops", "hops waiting to run", len(self.work), labels=labels),
                Sample("node_hop_seconds_total", "seconds spent running hops", c["hop_seconds"], "counter", labels)]
        for name in COUNTERS[1:]:
            rows.append(Sample(f"node_{name}_total", f"{name.replace('_', ' ')} on this node", c[name],
                               "counter", labels))
        return rows

    # -- failover -----------------------------------------------------------------------

    def _watch_routes(self, now: float) -> None:
        """Ping the hops active requests depend on; re-plan around the ones that died."""
        for sock in [*self.peer_of, *self.monitor_of]:
            self._drain(sock)  # pongs and link events that arrived while this node computed
        live = [rs for rs in self.sessions.values() if not rs.awaiting_route]
        keys = {h.endpoint: h.key for rs in live for h in rs.route if h.endpoint != self.endpoint}
        watched = set(keys)
        for endpoint in self.liveness.watch(watched, now):
            self._to_peer(endpoint, keys[endpoint], p.encode(p.Ping(self.rtt.ping(endpoint, now))))
        dead = self.liveness.dead(watched, now)
        for rs in live if dead else ():
            lost = {h.node for h in rs.route if h.endpoint in dead}
            if lost and now >= rs.replan_after:
                self._failover(rs, lost)
        self.liveness.forget(watched)

    def _failover(self, rs: RouteSession, lost: set[str]) -> None:
        if self.tracker is None:  # nobody to ask for another route: wait for them to come back
            rs.begin_failover(lost)
            rs.keep_route(lost, time.monotonic())
            return
        rs.begin_failover(lost)
        self.counters["failovers"] += 1
        self.pending_routes.append(rs.session)
        self._to_tracker(p.RouteRequest(self.config.source.model_id, tuple(sorted(rs.excluded))))

    def _route_for_failover(self, msg: p.Route | p.Error) -> None:
        if not self.pending_routes:
            return
        rs = self.sessions.get(self.pending_routes.popleft())
        if rs is None:
            return
        if isinstance(msg, p.Route):
            self._emit(rs, rs.reroute(splice(rs.route[0], msg.hops)))
        else:  # nothing else serves those layers: wait for the lost hops to come back
            rs.keep_route(rs.lost, time.monotonic())

    def _link_event(self, endpoint: str, frames: list) -> None:
        event = zmq.utils.monitor.parse_monitor_message([f.bytes for f in frames])["event"]
        self.liveness.link(endpoint, up=event != zmq.EVENT_DISCONNECTED)
        if event == zmq.EVENT_DISCONNECTED:
            self.rtt.relinked(endpoint)  # the PING after a reconnect waits for a handshake

    def _peer_reply(self, endpoint: str, frames: list) -> None:
        """A frame on a DEALER: a PONG (the peer lives) or an ERROR about a session."""
        try:
            msg, _ = p.decode(frames)
        except p.ProtocolError as exc:
            log.warning("bad frame from peer %s: %s", endpoint, exc)
            return
        self.liveness.seen(endpoint)
        if isinstance(msg, p.Pong):
            self.rtt.pong(endpoint, msg.nonce, msg.node)
        elif isinstance(msg, p.Error) and msg.session:
            self._to_session(msg.session, msg)

    # -- tracker ------------------------------------------------------------------------

    def _register(self) -> None:
        c = self.config
        self._to_tracker(p.Register(
            node_id=c.node_id, endpoint=self.endpoint, model=c.source.model_id, fingerprint=self.fingerprint,
            num_layers=c.shard.num_layers, start_layer=c.shard.start, end_layer=c.shard.end,
            hardware={"device": c.device, "dtype": str(self.executor.w.dtype).removeprefix("torch."),
                      "quant": c.quant or "none",
                      "threads": torch.get_num_threads(), "shard_bytes": self.executor.w.parameter_bytes(),
                      "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
            benchmark=self.benchmark, max_sessions=c.max_sessions, relay=self.relay.relay if self.relay else "",
            relay_key=self.relay.front_key if self.relay else ""))

    def _to_tracker(self, message: p.Message) -> None:
        if self.link is not None:
            self.link.send(message)

    def _tracker_reply(self, frames: list) -> None:
        try:
            msg, _ = p.decode(frames)
        except p.ProtocolError as exc:
            log.warning("bad frame from tracker: %s", exc)
            return
        self.link.answered(msg)
        if isinstance(msg, p.Error) and msg.code == p.ErrorCode.UNKNOWN_NODE:
            log.info("tracker does not know this node (restarted?): registering again")
            self._register()
        elif isinstance(msg, p.Route) or (isinstance(msg, p.Error) and msg.code in (
                p.ErrorCode.NO_ROUTE, p.ErrorCode.UNKNOWN_MODEL)):
            self._route_for_failover(msg)
        elif isinstance(msg, p.Ack):
            if msg.probe:
                self.probes = {h.endpoint: h.key for h in msg.probe
                               if h.node != self.config.node_id and h.endpoint != self.endpoint}
            if not msg.reachable:
                self._unreachable()

    def _benchmark(self, reps: int = 3) -> float:
        """Layer-steps per second for one decode token on a fixed workload."""
        ex, shard = self.executor, self.config.shard
        x = (torch.zeros((1, 1), dtype=torch.int64) if shard.is_first
             else torch.zeros((1, 1, ex.hidden_size), dtype=self.config.dtype))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            ex.run("__bench__", shard.start, shard.end, x, 0)
            ex.finish()
            best = min(best, time.perf_counter() - t)
        self.kv.drop("__bench__")
        return shard.size / max(best, 1e-9)

    # -- relay and round trips ----------------------------------------------------------

    def _start_relay(self, endpoint: str) -> None:
        """Dial the relay at ``endpoint``; its RELAY_OPENED gives us our public endpoint."""
        c = self.config
        key = c.relay_key or (c.security.tracker_key if c.security else None)
        self.relay = RelayLink(self.ctx, endpoint, c.node_id, security=c.security, key=key,
                               interval=c.relay_interval, timeout=c.relay_timeout)
        self.poller.register(self.relay.sock, zmq.POLLIN)
        log.info("node %s: opening a front on relay %s", c.node_id, endpoint)

    def _unreachable(self) -> None:
        """The tracker could not reach our endpoint: peers cannot either. Fall back to the
        configured relay (once), or say what is wrong."""
        if self.relay is not None:
            return
        if self.config.relay_fallback:
            log.warning("the tracker cannot reach this node at %s: switching to relay %s", self.endpoint,
                        self.config.relay_fallback)
            self._start_relay(self.config.relay_fallback)
        elif not self._warned_unreachable:
            self._warned_unreachable = True
            log.warning("the tracker cannot reach this node at %s, so peers cannot either: give an endpoint "
                        "they can dial (--advertise) or a relay (--relay, --relay-fallback)", self.endpoint)

    def _open_relay(self, stop: threading.Event) -> None:
        """Dial the relay and wait until it opened our front: the endpoint peers dial."""
        self._start_relay(self.config.relay)
        while not stop.is_set() and not self.relay.up:
            self._relay_tick(time.monotonic())
            if self.relay.sock.poll(100):
                self._drain(self.relay.sock)

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
            self._inbound(*got)
        elif isinstance(got, p.RelayOpened) and self.relay.reopened:
            self.relay.reopened = False
            self.endpoint = self.relay.front
            if self.config.security is not None:
                self.key = self.relay.front_key  # hops answer a relayed head through the relay
            if self.tracker is not None:
                self._register()

    def _reachable(self) -> bool:
        """Whether peers can reach this node: always, unless its relay is down (then it
        stops heartbeating, so the tracker drops it from plans until the relay is back)."""
        return self.relay is None or self.relay.up

    def _probe_peers(self, now: float) -> None:
        """PING the peers we send to and those the tracker named, to time the round trip."""
        if now < self._next_probe:
            return
        self._next_probe = now + self.config.probe_interval
        for endpoint, key in {**dict.fromkeys(self.peers, ""), **self.probes}.items():
            self._to_peer(endpoint, key, p.encode(p.Ping(self.rtt.ping(endpoint, now))))
