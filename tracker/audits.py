"""Audits as the tracker sees them: which nodes could re-run a hop, and verdicts from heads.

A head that audits a step asks which other nodes hold the suspect's layers with the same
weights (REPLICAS_REQUEST); the tracker answers from its registry (REPLICAS), least loaded
first. When two replicas agreed with each other and not with the suspect, the head sends a
settled VERDICT: the suspect is excluded from every plan from then on (while this tracker
runs, also after it expires and registers again), the exclusion is logged, and an ``audit``
event goes out on the feed. An unsettled VERDICT (no second replica, or three different
outputs) is an event only. The tracker trusts the heads of its swarm: in a secured swarm a
verdict comes from an allow-listed member, under its own node id.
"""
from __future__ import annotations

import logging
from typing import Callable

from fabric.wire.protocol import Ack, ErrorCode, Hop, ProtocolError, Replicas, ReplicasRequest, Verdict

from .events import EventRing
from .registry import Registry

log = logging.getLogger(__name__)

MAX_REPLICAS = 4  # replicas named in one answer; a verdict needs two


class Audits:
    def __init__(self, registry: Registry, events: EventRing, emit: Callable[[dict], None]):
        self.registry, self.events = registry, events
        self.emit = emit  # publishes an event on the feed

    def replicas(self, msg: ReplicasRequest) -> Replicas:
        """Nodes of the same model and weights that hold layers start..end, least loaded first,
        each as a hop over exactly those layers; none that ``exclude`` or an audit names."""
        skip = set(msg.exclude)
        nodes = [n for n in self.registry.snapshot() if n.model == msg.model and n.fingerprint == msg.fingerprint
                 and n.start_layer <= msg.start_layer and msg.end_layer <= n.end_layer and n.node_id not in skip]
        nodes.sort(key=lambda n: (n.sessions + n.queued, n.node_id))
        return Replicas(msg.audit, tuple(Hop(n.node_id, n.endpoint, msg.start_layer, msg.end_layer, key=n.public_key)
                                         for n in nodes[:MAX_REPLICAS]))

    def verdict(self, msg: Verdict) -> Ack:
        if self.registry.get(msg.node_id) is None:
            raise ProtocolError(f"node {msg.node_id!r} is not registered: only a head of this swarm audits",
                                ErrorCode.BAD_REQUEST)
        span = f"{msg.model} layers {msg.start_layer}-{msg.end_layer}"
        if not msg.settled:
            text = (f"audit by {msg.node_id}: {msg.suspect} and {', '.join(msg.witnesses) or 'a replica'} disagree on "
                    f"{span} and no majority settles it; nobody is excluded ({msg.detail})")
            log.warning("%s", text)
            self._event(msg, text, "audit_mismatch")
            return Ack(detail="reported")
        witnesses = " and ".join(msg.witnesses)
        text = (f"{msg.suspect} returned wrong results for {span}: {witnesses} agree with each other, not with it; "
                f"excluded from plans (audit by {msg.node_id}: {msg.detail})")
        if not self.registry.exclude(msg.suspect, text):
            return Ack(detail="already excluded")
        log.warning("%s", text)
        self._event(msg, text, "liar")
        return Ack(detail="excluded")

    def _event(self, msg: Verdict, text: str, code: str) -> None:
        suspect = self.registry.get(msg.suspect)
        self.emit(self.events.add("audit", text, node=msg.suspect, model=msg.model, code=code, by=msg.node_id,
                                  witnesses=list(msg.witnesses), layers=[msg.start_layer, msg.end_layer],
                                  endpoint=suspect.endpoint if suspect else "", detail=msg.detail))
