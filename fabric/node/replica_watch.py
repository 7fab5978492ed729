"""Whether anybody could check a hop: the head asks the tracker, and asks for taps only where someone could.

An audit re-runs the first hop past the head on a replica before anything else, and ends
there when the tracker names none (fabric/node/audit.py). The taps of a route whose first hop
past the head has no replica are then never read, and they are not free: on `meshnet up`'s
split, which holds no replica, the tail's taps of its decode steps (two count sketches, one of
them over the logits, and a frame a step) cost 8 streams a tenth of their tokens
(docs/BENCHMARKS.md, "Taps nobody could read").

So the head asks the tracker, as an audit would, who else holds that hop's layers, and keeps
the answer. A request that starts while the answer names nobody gets no tap id: no hop taps
its steps, and it is not drawn. Every request through that hop looks the same then, so a hop
still cannot tell which are audited; it learns only what the tracker's feed shows anyone
(nobody else holds its layers). While requests start, the answer is asked again every
RECHECK_S, so a replica that joins has requests tapped for it within seconds. Unknown means
tapped: a head with no tracker, or whose questions go unanswered for TRUST_S after the last
answer's, taps every request as before.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Callable, Collection

from ..wire import protocol as p

RECHECK_S = 10.0  # an answer is asked again this long after it was asked, when a request starts
TRUST_S = 30.0  # ...and a "nobody" believed this long after it came; past it, requests are tapped again
MAX_HOPS = 256  # hops whose answers a head keeps (the oldest go first)

Key = tuple[str, int, int]  # a hop: its node and its layers


@dataclass
class _Answer:
    nobody: bool = False  # the last answer named no replica
    since: float = -math.inf  # ...as of when its question went (when the tracker knew it, at the latest)
    asked: float = -math.inf
    question: str = ""  # the id of the REPLICAS_REQUEST in flight ("" none)


class ReplicaWatch:
    """``ask(question, hop)`` sends a REPLICAS_REQUEST with that id about ``hop``'s layers (False:
    this head has no tracker to ask); ``answer`` takes the tracker's REPLICAS."""

    def __init__(self, ask: Callable[[str, p.Hop], bool]):
        self.ask = ask
        self.hops: dict[Key, _Answer] = {}
        self.questions: dict[str, Key] = {}  # an open question's id -> the hop it asks about

    def checkable(self, hop: p.Hop, now: float) -> bool:
        """Whether an audit could find a replica of ``hop`` (the first hop past the head): False
        only while a recent answer named nobody. Asks again where the answer is RECHECK_S old."""
        key = (hop.node, hop.start_layer, hop.end_layer)
        answer = self.hops.pop(key, None) or _Answer()
        self.hops[key] = answer  # the most recently used last: the oldest go first
        while len(self.hops) > MAX_HOPS:
            self._forget(next(iter(self.hops)))
        if now - answer.asked >= RECHECK_S:
            self.questions.pop(answer.question, None)
            answer.question = secrets.token_hex(16)
            answer.asked = now
            if self.ask(answer.question, hop):
                self.questions[answer.question] = key
        return not (answer.nobody and now - answer.since < TRUST_S)

    def answer(self, msg: p.Replicas, skip: Collection[str] = ()) -> bool:
        """Take the tracker's answer to one of this watch's questions, a replica being any node it names
        but the hop's own and ``skip``'s; False: not one of them."""
        key = self.questions.pop(msg.audit, None)
        if key is None:
            return False
        answer = self.hops[key]  # an open question's hop is kept: forgetting a hop closes its question
        replicas = [h for h in msg.hops if h.node != key[0] and h.node not in skip]
        answer.nobody, answer.since, answer.question = not replicas, answer.asked, ""
        return True

    def _forget(self, key: Key) -> None:
        answer = self.hops.pop(key)
        self.questions.pop(answer.question, None)
