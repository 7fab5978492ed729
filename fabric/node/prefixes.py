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
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count

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


@dataclass
class _Entry:
    held: tuple[int, ...]  # the ids its hops hold
    route: tuple[Hop, ...]
    tenant: str
    blocks: list[int]  # the hash of each of its starts that ends a whole block (``PrefixIndex._chain``)
    stamp: int  # when it was added or last matched: the least recent wins a tie


class PrefixIndex:
    """Ended requests by session id: the ids every hop of their route holds, least recently
    used first. ``max_entries`` 0 turns reuse off.

    A match takes at least ``min_tokens``, so the index cuts the ids into blocks of that many
    and hashes each start that ends a whole block, chained from the route and the tenant: the
    entries that share a request's first k blocks are those under the hash of its k-block
    start. A match walks those hashes to the deepest that names an entry, and compares the
    ids only within the next block. Scanning every entry instead cost 45 ms a request where
    256 of them shared a 3,000-token start; the scan stays as the answer should two starts'
    hashes ever be the same (the best entry's start is compared whole)."""

    def __init__(self, max_entries: int = MAX_PREFIXES, min_tokens: int = MIN_REUSE_TOKENS):
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        self.block = max(1, min_tokens)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._starts: dict[int, set[str]] = {}  # a start's hash -> the entries that start so
        self._stamps = count()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, session: str, ids: list[int], route: tuple[Hop, ...], tenant: str = "") -> None:
        """``session`` of ``tenant`` ended and every hop of ``route`` keeps KV for ``ids``."""
        if self.max_entries <= 0 or len(ids) < self.min_tokens:
            return
        self.discard(session)
        held, hops = tuple(ids), tuple(route)
        blocks = list(self._chain(held, hops, tenant))
        for h in blocks:
            self._starts.setdefault(h, set()).add(session)
        self._entries[session] = _Entry(held, hops, tenant, blocks, next(self._stamps))
        while len(self._entries) > self.max_entries:
            self.discard(next(iter(self._entries)))

    def _chain(self, ids: tuple[int, ...], route: tuple[Hop, ...], tenant: str) -> Iterator[int]:
        """The hash of each start of ``ids`` that ends a whole block, on ``route`` for ``tenant``."""
        h, b = hash((route, tenant)), self.block
        for at in range(b, len(ids) + 1, b):
            h = hash((h, ids[at - b:at]))
            yield h

    def match(self, ids: list[int], route: tuple[Hop, ...], tenant: str = "") -> Reuse | None:
        """The longest kept start of ``ids`` on exactly these hops that ``tenant`` left (a
        fast first token would tell one tenant what another asked), leaving at least one
        token to compute (the tail needs one for logits). A match that takes all of an entry
        leaves the index: the hops hand that KV itself to the new session."""
        ids, hops = tuple(ids), tuple(route)
        usable = ids[:len(ids) - 1]
        depth, found = 0, set()
        for h in self._chain(usable, hops, tenant):
            if not (names := self._starts.get(h)):
                break
            depth, found = depth + 1, names
        at, b, best = depth * self.block, self.block, None
        for name in found:  # each shares the first `at` ids (unless two starts' hashes are the same)
            entry = self._entries[name]
            n = at + common_prefix(entry.held[at:at + b], usable[at:at + b])
            if best is None or (n, -entry.stamp) > (best.tokens, -self._entries[best.session].stamp):
                best = Reuse(name, n)
        if best is not None:
            entry = self._entries[best.session]
            if (entry.held[:at], entry.route, entry.tenant) != (usable[:at], hops, tenant):
                best = self._scan(ids, hops, tenant)
        return self._taken(best) if best is not None and best.tokens >= self.min_tokens else None

    def _scan(self, ids: tuple[int, ...], hops: tuple[Hop, ...], tenant: str) -> Reuse | None:
        """``match``'s answer from every entry (the least recent first: it wins a tie)."""
        best: Reuse | None = None
        for name, entry in self._entries.items():
            if entry.route != hops or entry.tenant != tenant:
                continue
            n = min(common_prefix(entry.held, ids), len(ids) - 1)
            if best is None or n > best.tokens:
                best = Reuse(name, n)
        return best

    def _taken(self, best: Reuse) -> Reuse:
        entry = self._entries[best.session]
        if best.tokens == len(entry.held):
            self.discard(best.session)  # moved: the new session will be kept in its place
        else:
            entry.stamp = next(self._stamps)
            self._entries.move_to_end(best.session)
        return best

    def discard(self, session: str) -> None:
        """A hop no longer holds ``session``'s KV (it answered CACHE_MISS), or the index lets it go."""
        entry = self._entries.pop(session, None)
        for h in entry.blocks if entry is not None else ():
            names = self._starts[h]
            names.discard(session)
            if not names:
                del self._starts[h]
