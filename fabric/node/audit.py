"""The head's side of audits: pick steps to check, re-run them on replicas, report liars.

Hidden states flow hop to hop, so a head never sees what a later hop received or computed.
A share ``audit_rate`` of the requests a head takes is audited: such a request starts at
position 0 (never from kept KV: a replica could not hold that KV), and its first step, as
well as that share of later steps at position 0 (re-prefills), names one of the route's
other hops in the FORWARD (``audit``). That hop sends back its input and output
(AUDIT_TAP, fabric/node/taps.py); the step's TOKEN is held meanwhile. The head asks the
tracker for replicas of those layers (REPLICAS_REQUEST), sends the input to one (AUDIT),
and compares its output with the suspect's (fabric/node/verdicts.py). They agree: the TOKEN
goes on. They differ: a second replica settles it, and the node the other two contradict is
convicted: the head tells the tracker (VERDICT), which drops it from plans, and moves its own
sessions off it; the held TOKEN of a convicted suspect is dropped and the step re-runs on a
route without it. With no second replica, or three different outputs, the mismatch is
reported and nobody is excluded.

Decode steps (which need a past KV no replica holds) are never audited. No sockets here:
the auditor is the RouteSessions' transport and sends through the node.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..compute.sampling import sample
from ..wire import protocol as p
from ..wire.liveness import AUDIT_RATE
from .route_session import Transport
from .verdicts import DEFAULT_TOLERANCE, Claim, Judgement, Outcome, judge

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditConfig:
    audit_rate: float = AUDIT_RATE  # share of requests (and of re-prefills) whose prefill one hop re-runs
    audit_tolerance: float = DEFAULT_TOLERANCE  # relative distance allowed between outputs not bit-exact by rule
    audit_timeout: float = 15.0  # seconds an audit waits for its tap, the tracker or a replica before it gives up


class AuditHost(Transport, Protocol):
    endpoint: str  # where replicas answer this head
    key: str

    def send_tensors(self, endpoint: str, key: str, message: p.Message, tensors: list[torch.Tensor]) -> None: ...
    def to_tracker(self, message: p.Message) -> bool: ...


@dataclass
class Pending:
    """One audit of one step of one session."""

    id: str
    session: str
    step: int
    target: p.Hop  # the audited hop: the suspect
    sampling: p.Sampling  # how the tail picks the step's token (checked against its logits)
    moved: float  # when the audit last moved on (begun, tapped, answered); it gives up a timeout after
    inputs: torch.Tensor | None = None  # what the suspect received, (1, q, hidden)
    suspect: Claim | None = None  # what it said it computed
    token: p.Token | None = None  # the step's TOKEN, held until the audit ends
    untried: list[p.Hop] | None = None  # replicas not asked yet; None: the tracker has not answered
    asked: list[str] = field(default_factory=list)  # replicas asked, in order
    answered: set[str] = field(default_factory=set)
    claims: list[Claim] = field(default_factory=list)  # the replicas' outputs, in the order asked
    whole: bool = True  # the tap covers the whole step, not only its first prefill chunk

    @property
    def sampled(self) -> bool:
        """The suspect is the tail and its tapped logits are the ones it sampled the step's token from."""
        return self.suspect is not None and self.suspect.output.dim() == 1 and self.whole  # logits (vocab,)


class Auditor:
    def __init__(self, config: AuditConfig, host: AuditHost, node_id: str, model: str, fingerprint: str,
                 counters: Counter, release: Callable[[p.Token], None], route_around: Callable[[str], None],
                 rng: random.Random | None = None):
        self.config = config
        self.host = host
        self.node_id, self.model, self.fingerprint = node_id, model, fingerprint
        self.counters = counters  # the node's: audits and their outcomes are counted here
        self.release = release  # hands a held TOKEN back to the head
        self.route_around = route_around  # moves the head's sessions off a convicted node
        self.rng = rng or random.Random(secrets.randbits(64))
        self.pending: dict[str, Pending] = {}  # audit id -> its state
        self.steps: dict[tuple[str, int], str] = {}  # (session, step) -> audit id
        self.convicted: set[str] = set()  # nodes this head found lying
        self.drawn: set[str] = set()  # requests to audit whose first step has not gone out yet

    def draw(self, session: str) -> bool:
        """Whether to audit the new request ``session``: then it must start at position 0."""
        if self.config.audit_rate > 0 and self.rng.random() < self.config.audit_rate:
            self.drawn.add(session)
            return True
        return False

    # -- the RouteSessions' transport: mark a step for audit on its way out -------------

    def forward(self, hop: p.Hop, message: p.Forward, tensor: torch.Tensor) -> None:
        if self._draw(message):
            target = self.rng.choice(message.route)
            message = dataclasses.replace(message, audit=target.start_layer)
            audit = Pending(secrets.token_hex(8), message.session, message.step, target, message.sampling,
                            time.monotonic())
            self.pending[audit.id] = audit
            self.steps[(audit.session, audit.step)] = audit.id
            self.counters["audits"] += 1
        self.host.forward(hop, message, tensor)

    def control(self, hop: p.Hop, message: p.Cancel | p.Close) -> None:
        self.host.control(hop, message)

    def _draw(self, m: p.Forward) -> bool:
        """A step that starts the session on every hop (position 0, no kept KV), past this head: a drawn
        request's first step, or a later one (a re-prefill) drawn now."""
        first = m.session in self.drawn and m.step == 0
        self.drawn.discard(m.session)
        if m.start_layer != 0 or m.pos != 0 or m.reuse or not m.route:
            return False
        return first or (m.step > 0 and self.config.audit_rate > 0 and self.rng.random() < self.config.audit_rate)

    # -- what comes back ----------------------------------------------------------------

    def hold(self, token: p.Token) -> bool:
        """Keep an audited step's TOKEN until its audit ends (then ``release`` gives it back)."""
        audit = self._of(token.session, token.step)
        if audit is None:
            return False
        audit.token = token
        self._advance(audit)
        return True

    def received(self, msg: p.AuditTap | p.AuditResult, tensors: list[torch.Tensor]) -> None:
        if isinstance(msg, p.AuditTap):
            self._tapped(msg, tensors)
        else:
            self._result(msg, tensors)

    def _tapped(self, msg: p.AuditTap, tensors: list[torch.Tensor]) -> None:
        audit = self._of(msg.session, msg.step)
        if audit is None or msg.node != audit.target.node or audit.suspect is not None:
            return  # a stale step, or a hop this audit did not name
        audit.moved = time.monotonic()
        audit.inputs = tensors[0]
        audit.suspect = Claim(msg.node, tensors[1], msg.kernels)
        audit.whole = not msg.more
        exclude = tuple(sorted({msg.node, self.node_id, *self.convicted}))
        if not self.host.to_tracker(p.ReplicasRequest(audit.id, self.model, self.fingerprint, msg.start_layer,
                                                      msg.end_layer, exclude)):
            self._end(audit, "skipped")  # no tracker, nobody to ask who holds those layers

    def replicas(self, msg: p.Replicas) -> None:
        """The tracker's answer: who else holds the suspect's layers with the same weights."""
        audit = self.pending.get(msg.audit)
        if audit is None or audit.untried is not None:
            return
        audit.moved = time.monotonic()
        audit.untried = [h for h in msg.hops if h.node not in (audit.target.node, self.node_id, *self.convicted)]
        self._advance(audit)

    def _result(self, msg: p.AuditResult, tensors: list[torch.Tensor]) -> None:
        audit = self.pending.get(msg.audit)
        if audit is None or msg.node not in audit.asked or msg.node in audit.answered:
            return
        audit.answered.add(msg.node)
        audit.moved = time.monotonic()
        if msg.error:
            log.warning("replica %s could not re-run audit %s: %s", msg.node, msg.audit, msg.error)
        else:
            audit.claims.append(Claim(msg.node, tensors[0], msg.kernels))
        self._advance(audit)

    # -- deciding -----------------------------------------------------------------------

    def _advance(self, audit: Pending) -> None:
        """Take the audit as far as what has arrived allows."""
        if audit.suspect is None or audit.untried is None or len(audit.answered) < len(audit.asked):
            return  # waiting for the tap, the tracker or a replica
        if audit.sampled and audit.token is None:  # the tail's claim includes the token it sent: judge with it
            if not audit.asked and audit.untried:
                self._ask(audit, audit.untried.pop(0))  # meanwhile a replica computes
            return
        suspect = audit.suspect
        if audit.sampled:
            consistent = sample(suspect.output, audit.sampling, audit.token.pos) == audit.token.token
            suspect = dataclasses.replace(suspect, consistent=consistent)
        verdict = judge(suspect, audit.claims, more=bool(audit.untried), tolerance=self.config.audit_tolerance)
        match verdict.outcome:
            case Outcome.PASS:
                self._end(audit, "passed")
            case Outcome.ASK if audit.untried:
                self._ask(audit, audit.untried.pop(0))
            case Outcome.ASK:
                log.info("audit of %s skipped: no replica holds layers %d-%d", audit.target.node,
                         audit.target.start_layer, audit.target.end_layer)
                self._end(audit, "skipped")
            case Outcome.LIAR:
                self._convict(audit, verdict)
            case Outcome.UNSETTLED:
                self._unsettled(audit, verdict)

    def _ask(self, audit: Pending, replica: p.Hop) -> None:
        audit.asked.append(replica.node)
        msg = p.Audit(audit.id, audit.target.start_layer, audit.target.end_layer, self.host.endpoint,
                      reply_key=self.host.key)
        self.host.send_tensors(replica.endpoint, replica.key, msg, [audit.inputs])

    def _convict(self, audit: Pending, verdict: Judgement) -> None:
        liar = verdict.liar
        self.convicted.add(liar)
        log.warning("node %s returned wrong results for layers %d-%d: %s agree with each other, not with it (%s); "
                    "excluding it", liar, audit.target.start_layer, audit.target.end_layer,
                    " and ".join(verdict.witnesses), verdict.detail)
        self._verdict(audit, liar, verdict, settled=True)
        self._end(audit, "convicted", release=liar != audit.target.node)  # a lying suspect's token is dropped
        self.route_around(liar)  # the session re-runs its step on a route without it

    def _unsettled(self, audit: Pending, verdict: Judgement) -> None:
        log.warning("audit of %s on layers %d-%d: a mismatch no majority settles (%s); nobody is excluded",
                    audit.target.node, audit.target.start_layer, audit.target.end_layer, verdict.detail)
        self._verdict(audit, audit.target.node, verdict, settled=False)
        self._end(audit, "unsettled")

    def _verdict(self, audit: Pending, suspect: str, verdict: Judgement, settled: bool) -> None:
        self.host.to_tracker(p.Verdict(self.node_id, self.model, suspect, audit.target.start_layer,
                                       audit.target.end_layer, witnesses=verdict.witnesses, settled=settled,
                                       detail=verdict.detail[:1024]))

    def _end(self, audit: Pending, outcome: str, release: bool = True) -> None:
        self.pending.pop(audit.id, None)
        self.steps.pop((audit.session, audit.step), None)
        self.counters[f"audits_{outcome}"] += 1
        if release and audit.token is not None:
            self.release(audit.token)

    # -- time and endings ---------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Give up audits that waited the timeout (for a tap, the tracker or a replica); a mismatch
        seen by then is reported unsettled."""
        for audit in [a for a in self.pending.values() if now - a.moved >= self.config.audit_timeout]:
            verdict = (judge(audit.suspect, audit.claims, more=False, tolerance=self.config.audit_tolerance)
                       if audit.suspect is not None and audit.claims else None)
            if verdict is not None and verdict.outcome == Outcome.UNSETTLED:
                self._unsettled(audit, verdict)
            else:
                log.info("audit of %s for session %s given up: no answer for %.0f s", audit.target.node,
                         audit.session, now - audit.moved)
                self._end(audit, "skipped")

    def forget(self, session: str) -> None:
        """The session ended: its audits are moot."""
        self.drawn.discard(session)
        for audit in [a for a in self.pending.values() if a.session == session]:
            self.pending.pop(audit.id)
            self.steps.pop((audit.session, audit.step), None)

    def _of(self, session: str, step: int) -> Pending | None:
        audit_id = self.steps.get((session, step))
        return None if audit_id is None else self.pending.get(audit_id)
