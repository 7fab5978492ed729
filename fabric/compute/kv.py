"""Hot KV state: per-session caches that stay on the node that computed them, and the KV
of ended sessions kept for reuse by later requests that share their prefix."""
from __future__ import annotations

import math
import mmap
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

GROW_MIN = 64  # positions a full buffer grows by at least


def spare(n: int) -> int:
    """``n`` positions and room to grow: half as much again, at least GROW_MIN more."""
    return n + max(GROW_MIN, n // 2)


LAZY_FROM = 1 << 20  # bytes from which a KV buffer on a CPU is mapped as it fills (smaller: the heap's)
# positions a buffer mapped as it fills has room for at least: the room no position reaches costs address
# space, not memory, and growing a buffer stalls a step (it copies every position), so it reserves far ahead
RESERVE_POSITIONS = 2048


def reserve(needed: int, have: int) -> int:
    """Positions for a buffer mapped as it fills that must hold ``needed`` and holds ``have``:
    RESERVE_POSITIONS at least, twice ``have`` once outgrown, else as many (more rows, say)."""
    return max(spare(needed), RESERVE_POSITIONS, 2 * have if needed >= have else have)


def mapped(shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor | None, mmap.mmap | None]:
    """Zeros of ``shape`` and ``like``'s dtype in pages the OS maps on first touch, zero already,
    and that memory; (None, None) under LAZY_FROM bytes, or where the OS refuses (memory strictly
    committed). Only what sessions write becomes resident: ``new_zeros`` wrote every byte of a
    group's room to spare, all of it resident, and took a fault a page inside the step that grew
    it (docs/BENCHMARKS.md, *A batch group's buffers*). Unmapped when the tensor goes."""
    nbytes = math.prod(shape) * like.element_size()
    if nbytes < LAZY_FROM:
        return None, None
    try:
        pages = mmap.mmap(-1, nbytes)  # anonymous: zero-filled by the OS as it is touched
    except OSError:
        return None, None
    return torch.frombuffer(pages, dtype=torch.uint8).view(like.dtype).view(shape), pages  # the tensor holds them


def room(needed: int, have: int) -> int:
    """Positions to allocate when ``needed`` no longer fit in ``have``. A first allocation
    (``have`` 0) of more than one position, a prompt, is exact: many prompts end without a
    decode step (kept KV, a miss replayed)."""
    if have == 0 and needed > 1:
        return needed
    return max(needed, spare(have))


@dataclass
class SessionKV:
    """One session's cache on this node, for layers ``start..end``."""

    cache: object  # a transformers DynamicCache holding only this hop's layers
    start: int
    end: int
    length: int = 0  # tokens the cache holds
    drafted: int = 0  # of those, the last ones a verification step drafted (the next step's pos may cut them off)
    last_used: float = field(default_factory=time.monotonic)
    group: object | None = None  # the RowGroup holding this session's KV in row ``row`` meanwhile (cache None)
    row: int = -1

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def nbytes(self) -> int:
        """Bytes of this session's KV (its row's while it is one of a group): room to grow included,
        unless it lies in memory the OS maps as it fills (``mapped``)."""
        if self.group is not None:
            return self.group.row_bytes(self.row)
        total = 0
        for layer in getattr(self.cache, "layers", ()):
            if hasattr(layer, "nbytes"):  # a buffer grown in place (fabric/compute/cache.py)
                total += layer.nbytes()
                continue
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total


KV_BUDGET_SHARE = 0.1  # by default a node keeps ended sessions' KV in this share of the memory available at start


def default_budget(device: str = "cpu") -> int:
    """Bytes of retained KV a node keeps by default: KV_BUDGET_SHARE of the memory free on
    its device (a GPU's free memory, else the RAM available to new processes)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(KV_BUDGET_SHARE * torch.cuda.mem_get_info(torch.device(device))[0])
    return int(KV_BUDGET_SHARE * _available_ram())


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class RetainedKV:
    """The KV of ended sessions, kept so that a later session sharing a prefix takes it over
    instead of computing it again: least recently used first out, within ``budget`` bytes.
    ``stats`` counts hits, misses, reused tokens and evictions."""

    def __init__(self, budget: int = 0):
        self.budget = budget  # bytes; 0 keeps nothing
        self._entries: OrderedDict[str, tuple[SessionKV, int]] = OrderedDict()  # session -> (KV, bytes)
        self.bytes = 0
        self.stats: Counter[str] = Counter({k: 0 for k in ("hits", "misses", "reused_tokens", "evictions")})

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: str) -> bool:
        return session in self._entries

    def keep(self, session: str, kv: SessionKV) -> list[str]:
        """Keep ``kv`` as the most recently used entry; returns the sessions evicted to fit it
        (``session`` itself when it alone is over the budget)."""
        self.pop(session)
        size = kv.nbytes()
        if size > self.budget:
            return [session]
        self._entries[session] = (kv, size)
        self.bytes += size
        evicted = []
        while self.bytes > self.budget:
            old, (_, freed) = self._entries.popitem(last=False)
            self.bytes -= freed
            evicted.append(old)
        self.stats["evictions"] += len(evicted)
        return evicted

    def peek(self, session: str) -> SessionKV | None:
        """The entry of ``session``, now the most recently used; None if not kept."""
        if session not in self._entries:
            return None
        self._entries.move_to_end(session)
        return self._entries[session][0]

    def pop(self, session: str) -> SessionKV | None:
        entry = self._entries.pop(session, None)
        if entry is None:
            return None
        self.bytes -= entry[1]
        return entry[0]

    def sessions(self) -> list[str]:
        """Kept sessions, least recently used first."""
        return list(self._entries)


class KVStore:
    """Live sessions by id, freed on close, cancel or idle timeout; ``retained`` keeps the
    KV of ended ones for reuse. Length and membership count live sessions only."""

    def __init__(self, idle_timeout: float = 300.0, retain_bytes: int = 0):
        self.idle_timeout = idle_timeout
        self._sessions: dict[str, SessionKV] = {}
        self.retained = RetainedKV(retain_bytes)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def get(self, session: str) -> SessionKV | None:
        return self._sessions.get(session)

    def put(self, session: str, kv: SessionKV) -> None:
        self._sessions[session] = kv

    def drop(self, session: str) -> bool:
        return self._sessions.pop(session, None) is not None

    def retain(self, session: str) -> list[str]:
        """End ``session``, keeping its KV for reuse; returns the retained sessions evicted."""
        kv = self._sessions.pop(session, None)
        if kv is None or kv.group is not None or kv.cache is None or self.retained.budget <= 0:
            return []  # nothing kept: no budget, or a batch group row not written back (the executor does that)
        return self.retained.keep(session, kv)

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Drop sessions unused for ``idle_timeout`` seconds; returns their ids."""
        now = time.monotonic() if now is None else now
        stale = [s for s, kv in self._sessions.items() if now - kv.last_used > self.idle_timeout]
        for s in stale:
            del self._sessions[s]
        return stale

    def active(self, now: float, within: float) -> int:
        """Live sessions used in the last ``within`` seconds (the others' heads went quiet)."""
        return sum(1 for kv in list(self._sessions.values()) if now - kv.last_used <= within)

    def nbytes(self) -> int:
        return sum(kv.nbytes() for kv in list(self._sessions.values()))

    def sessions(self) -> list[str]:
        return list(self._sessions)
