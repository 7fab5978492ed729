"""What the hops of ended requests still hold, as the head sent it: the token ids and the
route of each, so that a new request sharing a start with one of them computes only the rest.

Only the head knows token ids; the other hops see hidden states. So the head decides: it
finds the longest match on the request's own route and sends the first FORWARD at
``pos = n`` with ``reuse`` naming the ended session. Each hop starts the new session from
the KV it kept for that one (fabric/compute/executor.py ``take_over``): the KV itself when
the new request continues all of it, else a copy of its first n positions. A hop that has
dropped it meanwhile answers CACHE_MISS, and the head prefills in full as after any miss.
No sockets and no torch here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..wire.protocol import Hop

MAX_PREFIXES = 256  # ended requests the head remembers (the hops' budgets decide what they keep)
MIN_REUSE_TOKENS = 16  # a shorter match (a chat template's opening) is not worth a copy of its KV


@dataclass(frozen=True)
class Reuse:
    """Start a request from an ended session's KV: its first ``tokens`` positions."""

    session: str
    tokens: int


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common start of ``a`` and ``b`` (by bisection over slices,
    each compared in C: a 4,000-token match costs a dozen slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """Ended requests by session id: the ids every hop of their route holds, least recently
    used first. ``max_entries`` 0 turns reuse off."""

    def __init__(self, max_entries: int = MAX_PREFIXES, min_tokens: int = MIN_REUSE_TOKENS):
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        # session -> (ids its hops hold, its route, its tenant)
        self._entries: OrderedDict[str, tuple[tuple[int, ...], tuple[Hop, ...], str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, session: str, ids: list[int], route: tuple[Hop, ...], tenant: str = "") -> None:
        """``session`` of ``tenant`` ended and every hop of ``route`` keeps KV for ``ids``."""
        if self.max_entries <= 0 or len(ids) < self.min_tokens:
            return
        self._entries.pop(session, None)
        self._entries[session] = (tuple(ids), tuple(route), tenant)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def match(self, ids: list[int], route: tuple[Hop, ...], tenant: str = "") -> Reuse | None:
        """The longest kept start of ``ids`` on exactly these hops that ``tenant`` left (a
        fast first token would tell one tenant what another asked), leaving at least one
        token to compute (the tail needs one for logits). A match that takes all of an entry
        leaves the index: the hops hand that KV itself to the new session."""
        best: Reuse | None = None
        ids, key = tuple(ids), tuple(route)
        for name, (held, hops, owner) in self._entries.items():
            if hops != key or owner != tenant:
                continue
            n = min(common_prefix(held, ids), len(ids) - 1)
            if n >= self.min_tokens and (best is None or n > best.tokens):
                best = Reuse(name, n)
        if best is not None:
            if best.tokens == len(self._entries[best.session][0]):
                del self._entries[best.session]  # moved: the new session will be kept in its place
            else:
                self._entries.move_to_end(best.session)
        return best

    def discard(self, session: str) -> None:
        """A hop no longer holds ``session``'s KV (it answered CACHE_MISS)."""
        self._entries.pop(session, None)
