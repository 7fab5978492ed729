"""The head's side of audits: every step sketched, a share of sessions replayed on replicas.

Hidden states flow hop to hop, so a head never sees what a later hop received or computed;
and a hop that knew when it is checked could be honest only then. So nothing marks an
audited step. A head with ``audit_rate`` > 0 gives every request it heads (where someone could
check the first hop past it: fabric/node/replica_watch.py) a secret tap id
(32 hex digits, ``secrets.token_hex(16)``) and puts it in every FORWARD of that request;
every hop past the head answers every step with an AUDIT_TAP echoing it: count sketches of
its input and output rows, SKETCH_DIM numbers a position (fabric/node/verdicts.py), and on
the tail the token it sampled (fabric/node/taps.py). Prefill, decode step, chunk, batch:
every step of every request looks the same to a hop, and costs it one small frame.

The head draws a share ``audit_rate`` of its requests when they start, tells nobody, and
keeps the taps of those alone (fabric/node/rerun.py: ``Claims``), dropping the rest on
arrival. When such a request ends it replays a stretch of it (``Rerun``): once the tracker
names a replica of the first hop past it (none: the audit is skipped before it costs a
pass), its own layers on the token ids it sent (it trusts itself), then, hop by hop, the
previous stage's output to a replica of the next hop's layers (REPLICAS_REQUEST, AUDIT) in one pass, and compares the
replica's output with what the hop said at every position it computed: decode steps as
well as the prompt. On the tail, a random window of at most MAX_AUDIT_LOGITS positions
that produced tokens, logits and tokens. They agree: the replica's output feeds the next
stage. They differ: a second replica is asked; two replicas that agree with each other and
contradict the hop convict it: a settled VERDICT naming them goes to the tracker (which
checks it handed those replicas to this head), and the head moves its sessions off the
liar. Anything else (one replica, three outputs, a later hop whose input already differs
from the replay's) is reported unsettled and convicts nobody.

Nobody can answer for another: a tap counts only with the session's tap id, which only
the route's hops receive, and only the first tap of a step and position counts; an
AUDIT_RESULT only with the unguessable id sent to that one replica (each replica its own),
once. In a CURVE swarm each must also come with the key the tracker lists for that node
(REPLICAS' ``suspect_key`` and hop keys): a hop's taps from another key void its check.

The price: a tap per step per hop (SKETCH_DIM float32 numbers a position: 128 bytes on a
decode step, a few hundred bytes of sketching work), and per audited request about one
prefill of its stretch on every layer (two where a hop disagrees). A swarm that holds no
replica of the head's next hop, where nobody could check it, pays neither: no taps, no
replay. The request whose replay convicts a liar was already answered by it: an audit
cannot hold a token without showing which step it checks.

No sockets here: the auditor is the RouteSessions' transport and sends through the node.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..wire import protocol as p
from ..wire.liveness import AUDIT_RATE
from .replica_watch import ReplicaWatch
from .rerun import Claims, Rerun, replica_claim
from .route_session import Transport
from .verdicts import DEFAULT_TOLERANCE, Judgement, Outcome, judge, row_distances, sketch

log = logging.getLogger(__name__)

MAX_KEPT = 64  # sessions whose taps a head keeps at once (drawn, running or being replayed); more are not drawn
MAX_RERUNS = 8  # replays in flight at once; a session that ends beyond that is not replayed
# A drawn session's replay starts this long after it ended: hops send a step's tap after the whole
# pass's tokens and forwards (fabric/node/pass_on.py), so the last step's taps may follow its last token.
TAP_GRACE_S = 0.5
# A replay runs in slices between the streams' decode batches (fabric/node/pass_on.py), so a long
# stretch takes a while on a busy node: a replay waits this much longer per position it re-runs.
REPLAY_S_PER_POSITION = 0.005


@dataclass(frozen=True)
class AuditConfig:
    audit_rate: float = AUDIT_RATE  # share of requests whose steps replicas re-run after they end
    audit_tolerance: float = DEFAULT_TOLERANCE  # relative distance allowed between a hop's and a replica's outputs
    audit_timeout: float = 15.0  # seconds a replay waits for the tracker or a replica before it gives up


class AuditHost(Transport, Protocol):
    endpoint: str  # where replicas answer this head
    key: str  # this node's CURVE key ("" in plaintext): a secured head checks its peers' keys

    def send_tensors(self, endpoint: str, key: str, message: p.Message, tensors: list[torch.Tensor]) -> None: ...
    def to_tracker(self, message: p.Message) -> bool: ...


class Auditor:
    def __init__(self, config: AuditConfig, host: AuditHost, node_id: str, model: str, fingerprint: str,
                 counters: Counter, route_around: Callable[[str], None], rng: random.Random | None = None):
        self.config = config
        self.host = host
        self.node_id, self.model, self.fingerprint = node_id, model, fingerprint
        self.counters = counters  # the node's: audits and their outcomes are counted here
        self.route_around = route_around  # moves the head's sessions off a convicted node
        self.rng = rng or random.Random(secrets.randbits(64))
        self.tap_ids: dict[str, str] = {}  # session -> its tap id (every request this head heads)
        self.open_taps: set[str] = set()  # ...the same ids, to look a tap up by
        self.kept: dict[str, Claims] = {}  # tap id -> the claims of a drawn session
        self.reruns: dict[str, Rerun] = {}  # an open AUDIT's or REPLICAS_REQUEST's id -> its replay
        self.closing: dict[str, float] = {}  # tap id of a drawn session that ended -> when its replay starts
        self.convicted: set[str] = set()  # nodes this head found lying
        self.watch = ReplicaWatch(self._ask_replicas)  # who could check a route's first hop past this node

    def draw(self, session: str, ids: list[int], past: p.Hop | None = None, now: float | None = None) -> bool:
        """A new request ``session`` whose prompt is ``ids``, and whose first hop past this node is
        ``past`` (None: none, or unknown): give it a tap id, and whether it is audited. None where
        the tracker lately named no replica of ``past``: no audit could check it, so its hops are
        asked for no taps (fabric/node/replica_watch.py)."""
        if self.config.audit_rate <= 0:
            return False
        if past is not None and not self.watch.checkable(past, time.monotonic() if now is None else now):
            self.counters["audits_untapped"] += 1
            return False
        self.tap_ids[session] = tap = secrets.token_hex(16)
        self.open_taps.add(tap)
        if len(self.kept) >= MAX_KEPT or self.rng.random() >= self.config.audit_rate:
            return False
        self.kept[tap] = Claims(session, list(ids))
        self.counters["audits"] += 1
        return True

    # -- the RouteSessions' transport: every FORWARD carries its session's tap id ---------

    def forward(self, hop: p.Hop, message: p.Forward, tensor: torch.Tensor) -> None:
        tap = self.tap_ids.get(message.session, "")
        if tap:
            message = dataclasses.replace(message, audit=tap)
            if tap in self.kept and message.start_layer == 0:
                self.kept[tap].sent((hop, *message.route), message, tensor)
        self.host.forward(hop, message, tensor)

    def control(self, hop: p.Hop, message: p.Cancel | p.Close) -> None:
        self.host.control(hop, message)

    def ended(self, session: str, now: float | None = None) -> None:
        """The request ended: if it was drawn, replay a stretch of it once its last taps are in
        (``tick``, TAP_GRACE_S on)."""
        tap = self.tap_ids.pop(session, "")
        if tap in self.kept:
            self.closing[tap] = (time.monotonic() if now is None else now) + TAP_GRACE_S
        else:
            self.open_taps.discard(tap)

    def _replay(self, tap: str) -> None:
        """Replay a stretch of the drawn session whose taps ``tap`` names, which ended."""
        self.open_taps.discard(tap)
        claims = self.kept.get(tap)
        if claims is None:
            return
        n, window = claims.stretch(self.rng)
        if n == 0 or len(claims.route) < 2 or len({id(r) for r in self.reruns.values()}) >= MAX_RERUNS:
            self.kept.pop(tap)
            self.counters["audits_skipped"] += 1
            return
        rerun = Rerun(claims, n, window, time.monotonic(), tap=tap,
                      input=torch.tensor([claims.ids[:n]], dtype=torch.int64))  # (1, n)
        self._ask_tracker(rerun)  # stage 0, this node's own layers, runs once someone can check the next hop

    def moved(self, old: str, new: str) -> None:
        """A request went to a new route under a new session id: what was kept of it is dropped
        (the new route prefills it all again), and it goes on under a new tap id, which the
        hops of the old route never saw."""
        tap = self.tap_ids.pop(old, "")
        if not tap:
            return
        self.open_taps.discard(tap)
        self.kept.pop(tap, None)
        self.tap_ids[new] = fresh = secrets.token_hex(16)
        self.open_taps.add(fresh)

    # -- what comes back ----------------------------------------------------------------

    def received(self, msg: p.AuditTap | p.AuditResult, tensors: list[torch.Tensor], sender: str = "") -> None:
        """A tap or a replica's result, with the CURVE key it came with ("" in plaintext)."""
        taken = self._tap(msg, tensors, sender) if isinstance(msg, p.AuditTap) else self._result(msg, tensors, sender)
        if not taken:
            self.counters["audit_frames_ignored"] += 1

    def _tap(self, msg: p.AuditTap, tensors: list[torch.Tensor], sender: str) -> bool:
        claims = self.kept.get(msg.tap)
        if claims is None:
            return msg.tap in self.open_taps  # a session not drawn: dropped, as meant
        return claims.session == msg.session and claims.take(msg, tensors, sender)

    def _result(self, msg: p.AuditResult, tensors: list[torch.Tensor], sender: str) -> bool:
        rerun = self.reruns.get(msg.audit)
        hop = rerun.asked.get(msg.audit) if rerun is not None else None
        if hop is None or (self.host.key and sender != hop.key):
            return False  # not an answer to an AUDIT of ours, or not from the node we asked
        del self.reruns[msg.audit], rerun.asked[msg.audit]
        rerun.moved = time.monotonic()
        if msg.error or not tensors:
            log.warning("node %s could not re-run layers %d-%d: %s", hop.node, hop.start_layer, hop.end_layer,
                        msg.error)
            if rerun.stage == 0:
                self._end(rerun, "skipped")
            else:
                self._advance(rerun)
            return True
        if rerun.stage == 0:  # this node's own layers: the input of the first hop past it, whose replicas are known
            rerun.next_stage(tensors[0], rerun.untried)
            self._advance(rerun)
        else:
            self._answer(rerun, hop, tensors[0])
        return True

    def replicas(self, msg: p.Replicas) -> None:
        """The tracker's answer: who else holds the stage's layers with the same weights."""
        if self.watch.answer(msg, {self.node_id, *self.convicted}):
            return
        rerun = self.reruns.pop(msg.audit, None)
        if rerun is None or rerun.request != msg.audit or rerun.untried is not None:
            return
        rerun.moved = time.monotonic()
        hop = rerun.hop
        if self.host.key and rerun.claims.keys.get(hop.start_layer, msg.suspect_key) != msg.suspect_key:
            log.warning("taps of layers %d-%d came with a key the tracker does not list for %s: not judged",
                        hop.start_layer, hop.end_layer, hop.node)
            self._end(rerun, "skipped")
            return
        skip = {hop.node, self.node_id, *self.convicted}
        rerun.untried = [h for h in msg.hops if h.node not in skip]
        if rerun.stage > 0:
            self._advance(rerun)
        elif rerun.untried:  # someone can check the first hop past this node: its own layers' replay first
            self._ask(rerun, rerun.claims.route[0])
        else:  # nobody could: the replay would cost this node's streams a prefill, for nothing
            self._skip(rerun)

    # -- deciding, stage by stage -------------------------------------------------------

    def _skip(self, rerun: Rerun) -> None:
        hop = rerun.hop
        log.info("audit of %s skipped: no replica holds layers %d-%d", hop.node, hop.start_layer, hop.end_layer)
        self._end(rerun, "skipped")

    def _ask_tracker(self, rerun: Rerun) -> None:
        """Ask the tracker who else holds the layers of the hop judged next (at stage 0, before
        this node replays its own: the first hop past it)."""
        hop = rerun.hop
        if not rerun.claims.rows.get(hop.start_layer):
            log.warning("audit of session %s: %s sent no sketch of layers %d-%d", rerun.claims.session, hop.node,
                        hop.start_layer, hop.end_layer)
            self._report(rerun, Judgement(Outcome.UNSETTLED, detail=f"{hop.node} sent no sketch of its steps"))
            return
        if rerun.stage > 1 and self._input_differs(rerun):
            return
        rerun.request = rerun.new_id()
        self.reruns[rerun.request] = rerun
        if not self._ask_replicas(rerun.request, hop, suspect=hop.node):
            self._end(rerun, "skipped")  # no tracker, nobody to ask who holds those layers

    def _ask_replicas(self, question: str, hop: p.Hop, suspect: str = "") -> bool:
        """REPLICAS_REQUEST ``question`` to the tracker: who else holds ``hop``'s layers (not it, this
        node or a node it convicted). With ``suspect`` the tracker lists the answer as witnesses a
        verdict on it may cite. False: this node has no tracker."""
        exclude = tuple(sorted({hop.node, self.node_id, *self.convicted}))
        return self.host.to_tracker(p.ReplicasRequest(question, self.model, self.fingerprint, hop.start_layer,
                                                      hop.end_layer, exclude, node_id=self.node_id, suspect=suspect))

    def _input_differs(self, rerun: Rerun) -> bool:
        """A hop past the first is judged on the replay's input only if it says it received that:
        else the stretch already differed upstream (a hop that passed on other than it sketched,
        or this one misreporting), which nobody can settle. Reported, and the replay ends."""
        hop, before = rerun.hop, rerun.claims.route[rerun.stage - 1]
        positions, rows = rerun.claims.inputs(hop, rerun.n)
        if not positions:
            return False
        far = [d for d in row_distances(rows, sketch(rerun.input[0, list(positions)]))
               if not d <= self.config.audit_tolerance]
        if not far:
            return False
        detail = (f"{hop.node} received other hidden states than {before.node}'s layers give at {len(far)} of "
                  f"{len(positions)} positions (relative distance up to {max(far):.3g})")
        self._report(rerun, Judgement(Outcome.UNSETTLED, witnesses=(before.node,), detail=detail))
        return True

    def _answer(self, rerun: Rerun, replica: p.Hop, output: torch.Tensor) -> None:
        suspect = rerun.claims.claim(rerun.hop, rerun.n, rerun.window)
        rerun.answers.append(replica_claim(replica.node, output, suspect.positions, rerun.window))
        rerun.outputs.append(output)
        self._advance(rerun)

    def _advance(self, rerun: Rerun) -> None:
        """Take the stage as far as what has arrived allows."""
        if rerun.untried is None or rerun.asked:
            return  # waiting for the tracker or a replica
        suspect = rerun.claims.claim(rerun.hop, rerun.n, rerun.window)
        greedy = rerun.claims.sampling.temperature == 0 and not rerun.claims.penalized  # tokens the logits' argmax
        verdict = judge(suspect, rerun.answers, more=bool(rerun.untried), tolerance=self.config.audit_tolerance,
                        greedy=greedy)
        if verdict.outcome != Outcome.PASS and rerun.answers:
            rerun.mismatch = verdict
        match verdict.outcome:
            case Outcome.PASS | Outcome.ODD_REPLICA:
                self._passed(rerun, verdict)
            case Outcome.ASK if rerun.untried:
                self._ask(rerun, rerun.untried.pop(0))
            case Outcome.ASK | Outcome.UNSETTLED if rerun.mismatch is not None:
                self._report(rerun, rerun.mismatch)
            case Outcome.ASK | Outcome.UNSETTLED:
                self._skip(rerun)
            case Outcome.LIAR:
                self._convict(rerun, verdict)

    def _passed(self, rerun: Rerun, verdict: Judgement) -> None:
        """The hop agrees with a replica: on to the next hop, with that replica's output as its input."""
        agreed = 0
        if verdict.outcome == Outcome.ODD_REPLICA:  # the first replica disagrees with two: reported, not convicted
            hop = rerun.hop
            log.warning("audit of %s on layers %d-%d: replica %s disagrees with it and with %s (%s)", hop.node,
                        hop.start_layer, hop.end_layer, verdict.liar, verdict.witnesses[0], verdict.detail)
            self.host.to_tracker(p.Verdict(self.node_id, self.model, verdict.liar, hop.start_layer, hop.end_layer,
                                           witnesses=verdict.witnesses, detail=verdict.detail[:1024]))
            agreed = 1
        if rerun.tail:
            self._end(rerun, "passed")
        else:
            rerun.next_stage(rerun.outputs[agreed])
            self._ask_tracker(rerun)

    def _ask(self, rerun: Rerun, replica: p.Hop) -> None:
        audit = rerun.new_id()  # one per replica: only it receives it
        rerun.asked[audit] = replica
        self.reruns[audit] = rerun
        logits_from = rerun.window if rerun.tail else -1
        msg = p.Audit(audit, replica.start_layer, replica.end_layer, self.host.endpoint, reply_key=self.host.key,
                      logits_from=logits_from)
        self.host.send_tensors(replica.endpoint, replica.key, msg, [rerun.input])

    def _convict(self, rerun: Rerun, verdict: Judgement) -> None:
        hop = rerun.hop
        self.convicted.add(verdict.liar)
        log.warning("node %s returned wrong results for layers %d-%d: %s agree with each other, not with it (%s); "
                    "excluding it", verdict.liar, hop.start_layer, hop.end_layer, " and ".join(verdict.witnesses),
                    verdict.detail)
        self._verdict(rerun, verdict, settled=True)
        self._end(rerun, "convicted")
        self.route_around(verdict.liar)

    def _report(self, rerun: Rerun, verdict: Judgement) -> None:
        hop = rerun.hop
        log.warning("audit of %s on layers %d-%d: a mismatch nothing settles (%s); nobody is excluded", hop.node,
                    hop.start_layer, hop.end_layer, verdict.detail)
        self._verdict(rerun, dataclasses.replace(verdict, liar=hop.node), settled=False)
        self._end(rerun, "unsettled")

    def _verdict(self, rerun: Rerun, verdict: Judgement, settled: bool) -> None:
        hop = rerun.hop
        witnesses = tuple(w for w in verdict.witnesses if w not in (hop.node, self.node_id))
        self.host.to_tracker(p.Verdict(self.node_id, self.model, hop.node, hop.start_layer, hop.end_layer,
                                       witnesses=witnesses, settled=settled, detail=verdict.detail[:1024]))

    def _end(self, rerun: Rerun, outcome: str) -> None:
        for key in [k for k, r in self.reruns.items() if r is rerun]:
            del self.reruns[key]
        self.kept.pop(rerun.tap, None)
        self.counters[f"audits_{outcome}"] += 1

    # -- time ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Start the replays of drawn sessions that ended TAP_GRACE_S ago; give up replays that
        waited the timeout (and REPLAY_S_PER_POSITION a position replayed) for the tracker or a
        replica (a mismatch seen by then is reported unsettled); forget drawn sessions that never
        ended here."""
        for tap in [t for t, due in self.closing.items() if now >= due]:
            del self.closing[tap]
            self._replay(tap)
        stale = {id(r): r for r in self.reruns.values()
                 if now - r.moved >= self.config.audit_timeout + REPLAY_S_PER_POSITION * r.n}
        for rerun in stale.values():
            if rerun.mismatch is not None:
                self._report(rerun, rerun.mismatch)
            else:
                log.info("audit of session %s given up at %s: no answer for %.0f s", rerun.claims.session,
                         rerun.hop.node, now - rerun.moved)
                self._end(rerun, "skipped")
        live = self.open_taps | {r.tap for r in self.reruns.values()}
        for tap in [t for t in self.kept if t not in live]:
            del self.kept[tap]
