"""Hot KV state: per-session caches that stay on the node that computed them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SessionKV:
    """One session's cache on this node, for layers ``start..end``."""

    cache: object  # a transformers DynamicCache holding only this hop's layers
    start: int
    end: int
    length: int = 0  # tokens the cache holds
    last_used: float = field(default_factory=time.monotonic)
    group: object | None = None  # a batch group holding this session's KV as one of its rows, meanwhile

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def nbytes(self) -> int:
        """Bytes of this session's KV (its share of a batch group's cache while it is a row there)."""
        cache, rows = (self.group.cache, len(self.group.kvs)) if self.group is not None else (self.cache, 1)
        total = 0
        for layer in getattr(cache, "layers", ()):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total // rows


class KVStore:
    """Sessions by id; freed on close, cancel or idle timeout."""

    def __init__(self, idle_timeout: float = 300.0):
        self.idle_timeout = idle_timeout
        self._sessions: dict[str, SessionKV] = {}

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

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Drop sessions unused for ``idle_timeout`` seconds; returns their ids."""
        now = time.monotonic() if now is None else now
        stale = [s for s, kv in self._sessions.items() if now - kv.last_used > self.idle_timeout]
        for s in stale:
            del self._sessions[s]
        return stale

    def nbytes(self) -> int:
        return sum(kv.nbytes() for kv in list(self._sessions.values()))

    def sessions(self) -> list[str]:
        return list(self._sessions)
