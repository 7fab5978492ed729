"""The head's side of a node: the requests it heads, the clients that sent them, failover.

A node that holds layer 0 takes GENERATE from clients. For each request it keeps a
RouteSession (fabric/node/route_session.py) and the client's identity on the ROUTER; it turns
the route's TOKEN, PROGRESS, CACHE_MISS and ERROR replies into client events (a long prompt's
prefill is never silence: each hop's PROGRESS becomes the client's), reports progress to the
tracker, and when a hop of an active route dies it asks the tracker for another.
No sockets here: the node passes frames in and sends what comes out through ``HeadHost``.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Protocol

from ..compute.grammar import problem as grammar_problem
from ..net.peer_liveness import splice
from ..wire import protocol as p
from ..wire.liveness import LINK_GRACE, PEER_SILENCE, PING_INTERVAL, TRACKER_SILENCE
from ..wire.route_drafts import RouteSpeculation
from .audit import AuditConfig, Auditor
from .draft_model import DraftModel
from .prefixes import PrefixIndex
from .route_session import RequestError, RouteSession, Transport, encode_prompt, new_session_id
from .speculation import DraftTiming, DraftYield, Speculation, SpeculationConfig, speculation_counts
from .tool_use import constrained, syntax_of, tool_syntax

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadConfig:
    ping_interval: float = PING_INTERVAL  # the head pings the hops of its active routes this often
    peer_silence: float = PEER_SILENCE  # a hop that answers nothing this long is dead (hung, unreachable)
    link_grace: float = LINK_GRACE  # a hop whose TCP link stays down this long is dead (its process died)
    hop_timeout: float = 30.0  # the head re-prefills a step that got no reply for this long
    progress_interval: float = 0.5  # seconds between progress reports of a request this node heads
    max_prompt_tokens: int = 4096  # the head refuses longer prompts
    wire_dtype: str = ""  # hidden states on the wire of routes this node heads ("": compute dtype)
    speculation: SpeculationConfig = SpeculationConfig()  # drafts verified in one trip (fabric/node/speculation.py)


class HeadHost(Transport, Protocol):
    """What the head needs of its node: its address, and ways out."""

    endpoint: str  # where hops answer this node (a relay's front once one opened)
    key: str  # the CURVE key hops answer it with ("" in plaintext)

    def reply(self, identity: bytes, message: p.Message) -> None: ...
    def busy(self) -> bool: ...  # no room for one more session (this node's own hop of it)
    def reach(self, hop: p.Hop) -> None: ...  # ProtocolError: no one can dial the hop after this node's
    def to_tracker(self, message: p.Message) -> bool: ...  # False: this node has no tracker


@dataclass(frozen=True)
class ServedModel:
    """The model a head serves: what it reports and how it reads prompts."""

    model_id: str
    num_layers: int
    tokenizer: object
    eos: frozenset[int]
    vocab_size: int = 0  # token ids are below this (0: unchecked)
    context: int = 0  # positions the model takes: prompt plus max_tokens fit in it (0: unchecked)
    fingerprint: str = ""  # the weights' digest: audits re-run hops on nodes with the same


class Head:
    def __init__(self, config: HeadConfig, host: HeadHost, node_id: str, model: ServedModel, counters: Counter,
                 prefixes: PrefixIndex | None = None, audit: AuditConfig = AuditConfig(audit_rate=0.0),
                 draft: DraftModel | None = None):
        self.config = config
        self.draft = draft  # the draft model (``--draft``) that drafts beside prompt lookup; None: lookup alone
        self.prefixes = prefixes if prefixes is not None else PrefixIndex()  # what ended requests left on hops
        self.host = host
        self.node_id = node_id
        self.model = model
        self.counters = counters  # the node's: failovers are counted here
        self.sessions: dict[str, RouteSession] = {}  # session id (secret: see new_session_id) -> request this node heads
        self.clients: dict[str, bytes] = {}  # session id -> the identity of the client's connection on the ROUTER
        self.requests: dict[tuple[bytes, str], str] = {}  # (client identity, its request id) -> session id
        # (session, asked at) of failovers awaiting the tracker's route, in request order
        self.pending_routes: deque[tuple[str, float]] = deque()
        # the chance a draft is kept, per n-gram length, learnt from every request headed: new ones start from it
        self.draft_yield = DraftYield.prior(config.speculation)
        self.draft_timing = DraftTiming()  # what its draft model costs (--draft), learnt likewise
        self.routes = RouteSpeculation()  # drafts and trips per route of the requests it headed, for /metrics
        # steps re-run on replicas (fabric/node/audit.py); it is the RouteSessions' transport
        self.auditor = Auditor(audit, host, node_id, model.model_id, model.fingerprint, counters,
                               route_around=self.route_around)

    def __len__(self) -> int:
        return len(self.sessions)

    # -- requests -----------------------------------------------------------------------

    def generate(self, identity: bytes, req: p.Generate) -> None:
        """Start a request; a bad one raises ProtocolError, a refused prompt is one event."""
        self._check_route(identity, req)
        try:
            syntax = syntax_of(self.model.tokenizer, req)
            prompt = encode_prompt(self.model.tokenizer, req, self.config.max_prompt_tokens)
            self._check_resume(req)
            self._check_grammar(req)
            if (calls := constrained(self.model.tokenizer, req, syntax)) is not req:
                self._check_grammar(calls, "tools")  # a parameters schema llguidance cannot enforce
            req = self._fit(calls, len(prompt))
        except RequestError as exc:
            self.host.reply(identity, p.Event(req.request_id, p.EventKind.ERROR, text=str(exc),
                                              error_code=exc.code, finish_reason=p.FinishReason.ERROR))
            return
        rs = RouteSession(req, prompt, tokenizer=self.model.tokenizer, eos=self.model.eos,
                          reply_to=self.host.endpoint, reply_key=self.host.key, transport=self.auditor,
                          seed=secrets.randbits(62), wire_dtype=self.config.wire_dtype,
                          tool_syntax=tool_syntax(req, syntax),
                          speculation=Speculation(self.config.speculation, shared=self.draft_yield,
                                                  timing=self.draft_timing)
                          if self.config.speculation.enabled and req.speculation else None)
        self._bind_draft(rs)
        self.sessions[rs.session] = rs
        self.clients[rs.session] = identity
        self.requests[(identity, req.request_id)] = rs.session
        if req.resume:
            log.warning("request %s: taking it over after %d tokens (its head died)", req.request_id, len(req.resume))
        self.auditor.draw(rs.session, prompt + list(req.resume), req.route[1] if len(req.route) > 1 else None)
        reused = self.prefixes.match(prompt + list(req.resume), req.route, tenant_of(req))
        self._emit(rs, rs.start(reused))

    def _bind_draft(self, rs: RouteSession) -> None:
        """A drafting request gets the draft model too, if the head has one, unless it samples with
        a seed of its own: prompt lookup's drafts keep its text the text of one-token steps, draw
        for draw, whatever the steps' sizes; a draft model's, under the acceptance rule, would make
        it depend on how many drafts each step carried, which timings decide."""
        sampling = rs.request.sampling
        if self.draft is not None and rs.speculation is not None and (not sampling.temperature or sampling.seed is None):
            rs.speculation.drafter = self.draft.bind(rs.session, rs.sampling)

    def _check_route(self, identity: bytes, req: p.Generate) -> None:
        """Refuse (ProtocolError) a request this node cannot start: not its head, a request id
        in flight, no room, a route that stops short, or a next hop no one can dial."""
        last = self.model.num_layers - 1
        if req.route[0].endpoint != self.host.endpoint:
            raise p.ProtocolError("this node is not the head of that route", p.ErrorCode.BAD_REQUEST)
        if (identity, req.request_id) in self.requests:
            raise p.ProtocolError("request id already in flight", p.ErrorCode.BAD_REQUEST)
        if self.host.busy():
            raise p.ProtocolError("node is at its session or queue limit", p.ErrorCode.BUSY)
        if req.route[-1].end_layer != last:
            raise p.ProtocolError(f"the route ends at layer {req.route[-1].end_layer}, not at the last layer "
                                  f"{last}", p.ErrorCode.BAD_REQUEST)
        if len(req.route) > 1:
            self.host.reach(req.route[1])  # later hops are reached by the hop before them (``_refuse_forward``)

    def _check_resume(self, req: p.Generate) -> None:
        """Resumed token ids, and those logit_bias names, must be ids of this model's vocabulary."""
        try:
            p.check_vocab(req.resume, self.model.vocab_size, "resume")
            p.check_vocab(req.penalties.bias_ids if req.penalties else (), self.model.vocab_size, "logit_bias")
        except p.ProtocolError as exc:
            raise RequestError(exc.code, str(exc)) from None

    @staticmethod
    def _check_grammar(req: p.Generate, field: str = "response_format") -> None:
        """A grammar that does not compile is refused here, not two hops away at the tail
        (``field``: what the client wrote it with; a tool call's grammar is checked once built)."""
        if req.grammar is not None and (wrong := grammar_problem(req.grammar)):
            raise RequestError(p.ErrorCode.BAD_REQUEST, f"{field}: {wrong}"[:2000])

    def request(self, identity: bytes, request_id: str) -> RouteSession | None:
        """The request ``request_id`` of the client on ``identity``, while this node heads it."""
        return self.sessions.get(self.requests.get((identity, request_id), ""))

    def _fit(self, req: p.Generate, prompt: int) -> p.Generate:
        """``req`` with a prompt of ``prompt`` tokens, its max_tokens fitted to the model's
        context: lowered when it asked to be (``fit_context``), else refused."""
        room = self.model.context - prompt
        if not self.model.context or req.max_tokens <= room:
            return req
        if req.fit_context and room >= max(1, len(req.resume)):
            return dataclasses.replace(req, max_tokens=room)
        raise RequestError(p.ErrorCode.BAD_REQUEST,
                           f"the prompt's {prompt} tokens plus max_tokens {req.max_tokens} exceed this model's "
                           f"context of {self.model.context} tokens: ask for at most {max(room, 0)}")

    def cancel(self, identity: bytes, request_id: str) -> bool:
        """The client on ``identity`` cancels its request ``request_id``; False when this node
        heads no such request of that connection's (another client's is not its to end)."""
        rs = self.request(identity, request_id)
        if rs is None:
            return False
        self._emit(rs, rs.cancel())
        return True

    def clients_gone(self, identities: set[bytes]) -> None:
        """The connections of ``identities`` closed: the requests they opened stop (cancelled,
        their KV kept for reuse), as if each client had sent CANCEL."""
        for session, identity in list(self.clients.items()):
            if identity in identities and (rs := self.sessions.get(session)) is not None:
                log.info("request %s: its client is gone; cancelling it", rs.request_id)
                self._emit(rs, rs.cancel())

    def deliver(self, session: str, msg: p.Token | p.Progress | p.CacheMiss | p.Error) -> None:
        """A reply from the route: the tail's token, a hop's prefill progress, cache miss or error."""
        rs = self.sessions.get(session)
        if rs is None:
            return  # a late reply for a request that already ended
        match msg:
            case p.Token():
                if rs.speculation is not None:
                    rs.speculation.streams = len(self.sessions)  # they share the hops' passes
                events = rs.on_token(msg)
            case p.CacheMiss():
                if rs.reused is not None:
                    self.prefixes.discard(rs.reused.session)  # a hop dropped it: do not offer it again
                events = rs.on_cache_miss(msg)
            case p.Error(code=p.ErrorCode.LEAVING, node=str() as node) if msg.step == rs.step:
                # a hop of the route leaves the swarm: go around it, as around a dead one
                if not rs.awaiting_route and any(h.node == node for h in rs.route[1:]):
                    self._failover(rs, {node}, time.monotonic())
                return
            case p.Progress():
                events = rs.on_progress(msg, time.monotonic(), self.config.progress_interval)
            case _:
                events = rs.on_error(msg)
        self._emit(rs, events)

    def tick(self, now: float) -> None:
        """Re-send steps that timed out; give up on route requests the tracker never answered."""
        self._expire_route_requests(now)
        for rs in list(self.sessions.values()):
            self._emit(rs, rs.check_timeout(now, self.config.hop_timeout))
        self.auditor.tick(now)

    def _emit(self, rs: RouteSession, events: list[p.Event]) -> None:
        identity = self.clients.get(rs.session)
        for event in events:
            if identity is not None:
                self.host.reply(identity, event)
        if rs.finished:
            self._count_speculation(rs)  # before it leaves ``sessions``: whoever sees it gone sees it counted
            self.routes.record(self._report(rs))  # (its route's figures too)
            if rs.speculation is not None:
                rs.speculation.close()  # its draft model's KV goes
            self.sessions.pop(rs.session, None)
            self.requests.pop((self.clients.pop(rs.session, b""), rs.request.request_id), None)
            self.auditor.ended(rs.session)
            if rs.finished != "error":  # the hops keep its KV (CLOSE, CANCEL): later requests may start from it
                self.prefixes.add(rs.session, rs.held_ids, rs.route, tenant_of(rs.request))
        elif time.monotonic() - rs.reported_at >= self.config.progress_interval:
            self._report(rs)  # progress for every request, streamed or not

    def _count_speculation(self, rs: RouteSession) -> None:
        """An ended request's verifications, for /metrics: trips, drafts sent and kept, steps sent
        ahead and those that held."""
        if (spec := rs.speculation) is not None:
            self.counters["spec_trips"] += spec.trips
            self.counters["spec_drafted"] += spec.drafted
            self.counters["spec_kept"] += spec.kept
            self.counters["spec_ahead"] += spec.aheads
            self.counters["spec_ahead_held"] += spec.aheads_held

    def _report(self, rs: RouteSession) -> p.Report:
        rs.reported_at = time.monotonic()
        report = p.Report(
            request_id=rs.request_id, node_id=self.node_id, model=self.model.model_id, route=rs.route,
            prompt_tokens=rs.prompt_tokens, completion_tokens=len(rs.generated), elapsed=rs.elapsed,
            final=rs.finished is not None, finish_reason=rs.finished, api_key=rs.request.api_key,
            max_tokens=rs.request.max_tokens, prefilled=rs.prefilled, prefill_tokens=rs.prefill.total,
            resumed=rs.resumed, ref=rs.ref, **speculation_counts(rs.speculation))
        self.host.to_tracker(report)
        return report

    # -- failover -----------------------------------------------------------------------

    def watched(self) -> dict[str, str]:
        """Endpoint -> key of the other hops that active routes depend on."""
        return {h.endpoint: h.key for rs in self.sessions.values() if not rs.awaiting_route
                for h in rs.route if h.endpoint != self.host.endpoint}

    def lost(self, dead: set[str], now: float) -> None:
        """Route around hops at the ``dead`` endpoints."""
        for rs in [rs for rs in self.sessions.values() if not rs.awaiting_route]:
            lost = {h.node for h in rs.route if h.endpoint in dead}
            if lost and now >= rs.replan_after:
                self._failover(rs, lost, now)

    def route_around(self, node: str) -> None:
        """An audit convicted ``node``: sessions through it re-run on routes without it."""
        for rs in [rs for rs in self.sessions.values() if not rs.awaiting_route]:
            if any(h.node == node for h in rs.route):
                self._failover(rs, {node}, time.monotonic())

    def _failover(self, rs: RouteSession, lost: set[str], now: float) -> None:
        rs.begin_failover(lost)
        if self._ask_route(rs, now):
            self.counters["failovers"] += 1

    def _ask_route(self, rs: RouteSession, now: float) -> bool:
        """Ask the tracker for a route around ``rs.excluded``; False when there is no tracker
        to ask (then ``rs`` stays on its route and waits for the lost hops to come back)."""
        if not self.host.to_tracker(p.RouteRequest(self.model.model_id, tuple(sorted(rs.excluded)))):
            rs.keep_route(rs.lost, now)
            return False
        self.pending_routes.append((rs.session, now))
        return True

    def _expire_route_requests(self, now: float) -> None:
        """A route request unanswered for TRACKER_SILENCE was lost with its tracker (killed, or
        restarted without it): its session stays on its route and asks again after a back-off,
        as when no route avoids the lost hops. Answers pair with requests in order, so only
        the oldest expire."""
        while self.pending_routes and now - self.pending_routes[0][1] >= TRACKER_SILENCE:
            rs = self.sessions.get(self.pending_routes.popleft()[0])
            if rs is not None and rs.awaiting_route:
                log.warning("session %s: the tracker did not answer its route request", rs.session)
                rs.keep_route(rs.lost, now)

    def route_answer(self, msg: p.Route | p.Error) -> None:
        """The tracker's answer to the oldest failover request."""
        if not self.pending_routes:
            return
        rs = self.sessions.get(self.pending_routes.popleft()[0])
        if rs is None or not rs.awaiting_route:
            return
        if isinstance(msg, p.Route):
            self._rekey(rs)
            self._emit(rs, rs.reroute(splice(rs.route[0], msg.hops)))
        elif rs.widen():  # nodes lost earlier, or the lost ones themselves, may be back
            self._ask_route(rs, time.monotonic())
        else:  # nothing else serves those layers: wait for the lost hops to come back
            rs.keep_route(rs.lost, time.monotonic())

    def _rekey(self, rs: RouteSession) -> None:
        """``rs`` moves to a new route under a new session id: hops of the old route (one of
        them dead, or convicted by an audit) can no longer name it, and each hop of the new
        one opens it afresh from its new upstream (fabric/node/owners.py)."""
        old, rs.session = rs.session, new_session_id()
        self.sessions[rs.session] = self.sessions.pop(old)
        self.clients[rs.session] = self.clients.pop(old)
        self.requests[(self.clients[rs.session], rs.request.request_id)] = rs.session
        self.auditor.moved(old, rs.session)


def tenant_of(req: p.Generate) -> str:
    """Whose kept KV a request may start from: the same API key and cache salt only. A match
    of kept KV shortens the time to the first token, which would tell one tenant what another
    asked."""
    return f"{req.api_key or ''}\n{req.cache_salt}"
