"""Audits as the tracker sees them: which nodes could re-run a hop, and verdicts from heads.

A head that replays a session asks which other nodes hold a hop's layers with the same
weights (REPLICAS_REQUEST, naming itself and the suspect); the tracker answers from its
registry (REPLICAS), least loaded first, with the key it lists for the suspect, and
remembers which replicas it named to which head about which suspect (for LISTING_S, at most
MAX_LISTINGS pairs). A settled VERDICT must come from a registered head (in a secured swarm,
under the key that registered it) and cite as witnesses two replicas the tracker named to
that head about that suspect: a head that ran no such audit cannot accuse anyone. It then
excludes the suspect from every plan for EXCLUSION_S (tracker/registry.py); another settled
verdict within that term confirms it and starts the term again; else it lapses. Each
exclusion is logged and published with its evidence (the ``audit`` event: the accusing
head, the witnesses, the distance measured, when it lapses), and STATUS shows why a node is
excluded. An unsettled VERDICT is an event only.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

from fabric.wire.protocol import Ack, ErrorCode, Hop, ProtocolError, Replicas, ReplicasRequest, Verdict

from .events import EventRing
from .registry import EXCLUSION_S, Registry

log = logging.getLogger(__name__)

MAX_REPLICAS = 4  # replicas named in one answer; a verdict needs two
MAX_LISTINGS = 4096  # (head, suspect) pairs whose named replicas the tracker remembers
LISTING_S = 3600.0  # a verdict may cite replicas named to its head this long ago at most


class Audits:
    def __init__(self, registry: Registry, events: EventRing, emit: Callable[[dict], None],
                 clock: Callable[[], float] = time.monotonic, term: float = EXCLUSION_S):
        self.registry, self.events = registry, events
        self.emit = emit  # publishes an event on the feed
        self.clock = clock
        self.term = term  # seconds a settled verdict excludes its suspect
        # (head, suspect) -> (replicas named to that head about that suspect, when last named)
        self.listings: OrderedDict[tuple[str, str], tuple[frozenset[str], float]] = OrderedDict()

    def replicas(self, msg: ReplicasRequest) -> Replicas:
        """Nodes of the same model and weights that hold layers start..end, least loaded first,
        each as a hop over exactly those layers; none that ``exclude`` or an audit names."""
        skip = set(msg.exclude) | {msg.suspect, msg.node_id}
        nodes = [n for n in self.registry.snapshot() if n.model == msg.model and n.fingerprint == msg.fingerprint
                 and n.start_layer <= msg.start_layer and msg.end_layer <= n.end_layer and n.node_id not in skip]
        nodes.sort(key=lambda n: (n.sessions + n.queued, n.node_id))
        hops = tuple(Hop(n.node_id, n.endpoint, msg.start_layer, msg.end_layer, key=n.public_key)
                     for n in nodes[:MAX_REPLICAS])
        if msg.node_id and msg.suspect and hops:
            self._list(msg.node_id, msg.suspect, {h.node for h in hops})
        suspect = self.registry.get(msg.suspect) if msg.suspect else None
        return Replicas(msg.audit, hops, suspect_key=suspect.public_key if suspect else "")

    def _list(self, head: str, suspect: str, named: set[str]) -> None:
        key = (head, suspect)
        old, _ = self.listings.pop(key, (frozenset(), 0.0))
        self.listings[key] = (old | named, self.clock())
        while len(self.listings) > MAX_LISTINGS:
            self.listings.popitem(last=False)

    def listed(self, head: str, suspect: str) -> frozenset[str]:
        """The replicas named to ``head`` about ``suspect`` within LISTING_S."""
        named, when = self.listings.get((head, suspect), (frozenset(), -LISTING_S))
        return named if self.clock() - when <= LISTING_S else frozenset()

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
        unlisted = set(msg.witnesses) - self.listed(msg.node_id, msg.suspect)
        if unlisted:
            raise ProtocolError(f"the tracker named no replica {', '.join(sorted(unlisted))} to {msg.node_id} to check "
                                f"{msg.suspect}: a verdict cites replicas its audit was given", ErrorCode.BAD_REQUEST)
        return self._exclude(msg, span)

    def _exclude(self, msg: Verdict, span: str) -> Ack:
        witnesses = " and ".join(msg.witnesses)
        text = (f"{msg.suspect} returned wrong results for {span}: {witnesses} agree with each other, not with it; "
                f"excluded from plans for {self.term:.0f} s unless confirmed (audit by {msg.node_id}: {msg.detail})")
        exclusion = self.registry.exclude(msg.suspect, text, self.term)
        confirmed = exclusion.confirmations > 1
        log.warning("%s%s", text, f" (confirmed, {exclusion.confirmations} verdicts)" if confirmed else "")
        self._event(msg, text, "liar", lapses_in=self.term, confirmations=exclusion.confirmations)
        return Ack(detail="confirmed" if confirmed else "excluded")

    def _event(self, msg: Verdict, text: str, code: str, **more) -> None:
        suspect = self.registry.get(msg.suspect)
        self.emit(self.events.add("audit", text, node=msg.suspect, model=msg.model, code=code, by=msg.node_id,
                                  witnesses=list(msg.witnesses), layers=[msg.start_layer, msg.end_layer],
                                  endpoint=suspect.endpoint if suspect else "", detail=msg.detail, **more))
