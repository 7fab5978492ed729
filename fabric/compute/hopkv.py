"""A hop's sessions and their KV: each session's own cache, the batch group whose rows hold
the KV of sessions decoding together, and the KV of ended sessions kept for reuse. No sockets.

``ShardExecutor`` (fabric/compute/executor.py) runs the layers over it; this part decides
where each session's KV is: its own cache (a prompt, a chunk), a row of the group (decode
steps in a batch), or the kept store (ended, waiting for a request that shares its prefix).
"""
from __future__ import annotations

import torch

from .kv import KVStore, SessionKV
from .rows import RowGroup

REUSABLE_KINDS = ("full_attention", "sliding_attention")  # layer kinds whose kept KV can serve a later prefix


class CacheMissError(Exception):
    """The session's KV is not here (evicted, restarted, or a different layer span)."""

    def __init__(self, have: int):
        super().__init__(f"session KV holds {have} tokens")
        self.have = have


class HopKV:
    """Sessions by id over a shard's layers, and the one batch group."""

    def __init__(self, config, kv: KVStore, layer_types: list[str]):
        self.config = config
        self.kv = kv
        self.layer_types = layer_types
        self.group: RowGroup | None = None  # the sessions that decode together, their KV in its rows
        self.rolled_back = 0  # drafted positions cut off sessions' KV after the tail rejected them

    def batchable(self, start: int, end: int) -> bool:
        """Decode steps over start..end can run as one batch (full attention everywhere)."""
        return all(self.layer_types[i] == "full_attention" for i in range(start, end + 1))

    def _group_for(self, start: int, end: int) -> RowGroup:
        """The batch group over start..end, rows whose session is gone freed. A group over
        other layers (a route that uses part of this shard) hands its rows back first."""
        group = self.group
        if group is not None and (group.start, group.end) != (start, end):
            for session in group.members():
                self._ungroup(self.kv.get(session))
            group = None
        if group is None:
            group = self.group = RowGroup(start, end)
        for row, session in enumerate(group.sessions):
            kv = self.kv.get(session) if session is not None else None
            if session is not None and (kv is None or kv.group is not group or kv.row != row):
                group.free(row)
        return group

    def _join(self, group: RowGroup, session: str, kv: SessionKV, layers: dict | None = None) -> None:
        """Move ``session``'s KV into a free row of ``group``: from its own cache, or ``layers``."""
        if layers is None:
            layers = {i: (kv.cache.layers[i].keys, kv.cache.layers[i].values) for i in range(group.start, group.end + 1)}
        kv.row = group.join(session, layers)
        kv.cache, kv.group = None, group

    def _ungroup(self, kv: SessionKV | None) -> None:
        """Move a session's KV out of its row into a cache of its own; the row is freed."""
        if kv is None or kv.group is None:
            return
        group, cache = kv.group, self._new_cache()
        for i, (keys, values) in group.take(kv.row).items():  # its own copy: the layers hold it as it is
            cache.layers[i].adopt(keys, values)
        kv.cache, kv.group, kv.row = cache, None, -1
        if not group.members() and group is self.group:
            self.group = None  # nobody left: its buffers go

    def _rows(self, steps, kvs: list[SessionKV]) -> tuple[RowGroup, list[int], int, int]:
        """The batch group over the steps' layers, each step's session in it (joining a free
        row if not yet) and the steps' rows side by side: (group, each step's row, lo, hi) for
        a pass over rows lo..hi."""
        group = self._group_for(steps[0].start, steps[0].end)
        for step, kv in zip(steps, kvs):
            if kv.group is not group:
                self._join(group, step.session, kv)
        rows = [kv.row for kv in kvs]
        if max(rows) + 1 - min(rows) > len(rows):
            rows = self._close_up(group, kvs)
        return group, rows, min(rows), max(rows) + 1

    def _close_up(self, group: RowGroup, kvs: list[SessionKV]) -> list[int]:
        """Move the rows of ``kvs`` next to each other (the rows they displace take their
        places): a pass runs every row from its first to its last, those between as masked
        dummies, so a batch spread over the group would cost the whole group's pass. Rows move
        only when the line-up changes (streams that run as two groups keep a half each).
        Returns the kvs' rows."""
        for a, b in group.gathering([kv.row for kv in kvs]):
            group.swap(a, b)
            for row in (a, b):
                if group.sessions[row] is not None:
                    self.kv.get(group.sessions[row]).row = row
        return [kv.row for kv in kvs]

    def _new_cache(self):
        from .cache import new_cache

        return new_cache(self.config)

    def reusable(self, start: int, end: int) -> bool:
        """A session's KV over start..end can serve a later request's prefix: attention layers,
        full or sliding-window (those keep their window and a little more: fabric/compute/cache.py)."""
        return all(self.layer_types[i] in REUSABLE_KINDS for i in range(start, end + 1))

    @torch.inference_mode()
    def retain(self, session: str) -> list[str]:
        """``session`` ended here: keep its KV for a later session that shares its prefix
        (within the store's budget, on a span that can be cut), else free it. Returns the
        kept sessions evicted to make room."""
        from .cache import trim

        kv = self.kv.get(session)
        if kv is None or not self.reusable(kv.start, kv.end) or self.kv.retained.budget <= 0:
            self.free_row(session)
            self.kv.drop(session)
            return []
        self._ungroup(kv)  # a row of the batch group comes out as a cache of its own
        trim(kv.cache)  # kept, not appended to: no room to spare
        return self.kv.retain(session)

    def take_over(self, reuse: str, session: str, start: int, end: int, pos: int, row: bool = False) -> SessionKV:
        """Start ``session`` with the first ``pos`` positions of the KV kept for ``reuse``: the
        entry itself when it holds exactly pos (the new session continues all of it), else a
        copy of its prefix, the entry staying for others; with ``row`` (a session that decodes
        in the batch group next) the copy goes straight into a row of the group. CacheMissError
        when no entry holds that much over this span, or whose sliding-window layers kept too
        little before pos (they keep their window and cache.SLACK more: a prefix may stop at
        most that short).
        Positions a last verification step drafted are cut off, not copied: the head offers
        only what it knows every hop holds, and never a drafted position past that."""
        from .cache import roll_back

        retained = self.kv.retained
        old = retained.peek(reuse)
        cache = layers = None
        if old is not None and old.length >= pos and (old.start, old.end) == (start, end):
            if old.length - old.drafted <= pos < old.length and roll_back(old.cache, start, end, pos):
                old.length, old.drafted = pos, 0  # what followed was drafted, and never offered: cut, not copied
            if old.length == pos:
                cache = old.cache
            elif row and self.batchable(start, end):  # views: the group's row takes the one copy
                layers = {i: (old.cache.layers[i].keys[:, :, :pos], old.cache.layers[i].values[:, :, :pos])
                          for i in range(start, end + 1)}
            else:
                cache = self._prefix(old.cache, start, end, pos)
        if cache is None and layers is None:
            retained.stats["misses"] += 1
            raise CacheMissError(0)
        if cache is old.cache:
            retained.pop(reuse)
        kv = SessionKV(cache=cache, start=start, end=end, length=pos)
        self._put(session, kv)
        if layers is not None:
            self._join(self._group_for(start, end), session, kv, layers)
        retained.stats["hits"] += 1
        retained.stats["reused_tokens"] += pos
        return kv

    def _prefix(self, cache, start: int, end: int, n: int):
        """A new cache holding copies of the first ``n`` positions of ``cache``'s layers
        start..end (a sliding-window layer's last ones of them); None where they are gone."""
        from .cache import prefix

        return prefix(cache, self.config, start, end, n)

    @torch.inference_mode()
    def free_row(self, session: str) -> None:
        """``session`` ended here: free its row of the batch group, if it has one."""
        row = self.group.row(session) if self.group is not None else None
        if row is not None:
            self.group.free(row)
            if not self.group.members():
                self.group = None

    def _put(self, session: str, kv: SessionKV) -> None:
        """``kv`` is ``session``'s from now on; a row its former KV held is freed."""
        self.free_row(session)
        self.kv.put(session, kv)

    def _session_kv(self, session: str, start: int, end: int, pos: int) -> SessionKV:
        if pos == 0:
            kv = SessionKV(cache=self._new_cache(), start=start, end=end)
            self._put(session, kv)
            return kv
        kv = self.kv.get(session)
        if kv is not None and (kv.start, kv.end) == (start, end) and kv.length - kv.drafted <= pos < kv.length:
            self.roll_back(kv, pos)
        if kv is None or kv.length != pos or (kv.start, kv.end) != (start, end):
            raise CacheMissError(0 if kv is None else kv.length)
        return kv

    @torch.inference_mode()
    def roll_back(self, kv: SessionKV, pos: int) -> None:
        """The session's last step drafted positions that the tail rejected: the next step comes
        at ``pos``, inside them, and the session keeps its first ``pos`` positions. A row of the
        batch group or a cache of its own is cut in place: lengths change, nothing is copied.
        Only those drafted positions can be cut this way (a step anywhere else is a cache miss)."""
        from .cache import roll_back

        if kv.group is not None:
            kv.group.roll_back(kv.row, pos)
        elif not roll_back(kv.cache, kv.start, kv.end, pos):
            return  # a layer that cannot be cut: the step finds its length wrong, a cache miss
        self.rolled_back += kv.length - pos
        kv.length, kv.drafted = pos, 0

