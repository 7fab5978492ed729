"""The console ring: the last few hundred human-facing events, kept in memory.

Kinds: ``route selected``, ``connected``, ``handover``, ``progress``, ``complete``, ``error``, ``left``,
``audit`` (a head's audit caught a node returning wrong results, or found a mismatch it could not settle),
``fetch`` (a fetch of weights from peers caught a peer sending bad bytes, finished, or failed).
A ``progress`` event is updated in place for its request (keyed by request id) instead
of appended, so a long generation occupies one row whose tokens and tok/s move.
Every event has a stable ``id`` and a ``seq`` that grows on every insert or update,
so a poller can ask for "everything newer than seq N".
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

KINDS = ("route selected", "connected", "handover", "progress", "complete", "error", "left", "audit", "fetch")


class EventRing:
    def __init__(self, size: int = 200, clock: Callable[[], float] = time.time):
        self._events: deque[dict] = deque(maxlen=size)
        self._clock = clock
        self._seq = 0

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def add(self, kind: str, message: str, key: str | None = None, **fields) -> dict:
        """Append an event; returns it (a fresh dict, safe to publish)."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        seq = self._next_seq()
        now = self._clock()
        event = {"id": seq, "seq": seq, "ts": now, "updated": now, "kind": kind,
                 "key": key, "message": message, **fields}
        self._events.append(event)
        return dict(event)

    def upsert(self, kind: str, key: str, message: str, **fields) -> dict:
        """Update the newest ``kind`` event for ``key`` in place, or append one."""
        for event in reversed(self._events):
            if event["kind"] == kind and event["key"] == key:
                event.update(fields, message=message, seq=self._next_seq(), updated=self._clock())
                return dict(event)
        return self.add(kind, message, key=key, **fields)

    def recent(self, limit: int | None = None, since: int = 0) -> list[dict]:
        """Events (oldest first) whose seq is above ``since``; at most the last ``limit``."""
        events = [dict(e) for e in self._events if e["seq"] > since]
        return events[-limit:] if limit else events

    def __len__(self) -> int:
        return len(self._events)
