"""Sessions that decode together, their KV kept where the batch reads it. No sockets.

A ``RowGroup`` holds, for each layer of a span, one buffer (rows, kv_heads, columns,
head_dim): row r holds one session's positions. A decode step of the sessions in rows
lo..hi is one forward pass that reads rows lo..hi in place and writes each row's new
position into column ``width``, the same column for every row, so a step copies nothing
but the new keys and values. Columns need not be in order: rotary positions are applied
to keys before they are cached, so attention does not care where a key sits, and ``valid``
(rows, columns) says which columns of a row hold its positions. The rest is masked: a row
that joined shorter than the others (as left padding did), a row with no step in that pass
(it runs as a dummy whose column is never valid), a free row.

KV moves only when the line-up changes: a session joins by copying its KV into a free row,
leaves by freeing the row (``take`` copies it out first where the session still needs it),
and the buffers are rebuilt when full, packing each row's positions to its front when holes
are most of the width.
"""
from __future__ import annotations

import torch

from .kv import spare

MIN_ROWS = 4  # rows allocated at least; more double


class RowGroup:
    """The KV of sessions decoding together over layers ``start..end``, one row each."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.sessions: list[str | None] = []  # per row; None: a free row
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (rows, kv_heads, columns, head_dim)
        self.values: dict[int, torch.Tensor] = {}
        self.valid: torch.Tensor | None = None  # (rows, columns) bool: which columns hold a row's positions
        self.width = 0  # columns in use; every column from here on is free in every row
        self.column_bytes = 0  # bytes of one column of one row, over every layer's keys and values

    def row(self, session: str) -> int | None:
        try:
            return self.sessions.index(session)
        except ValueError:
            return None

    def members(self) -> list[str]:
        return [s for s in self.sessions if s is not None]

    def join(self, session: str, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy a session's KV, {layer: (keys, values)} each (1, kv_heads, n, head_dim), into
        a free row; returns the row."""
        k0, _ = layers[self.start]
        n = k0.shape[-2]
        if not self.keys:
            self._allocate(k0, MIN_ROWS, spare(n))
        row = self._free_row()
        if n > self.valid.shape[1]:
            self._rebuild(len(self.sessions), spare(n), pack=False)
        for i, (k, v) in layers.items():
            self.keys[i][row, :, :n] = k[0]
            self.values[i][row, :, :n] = v[0]
        self.valid[row] = False
        self.valid[row, :n] = True
        self.width = max(self.width, n)
        self.sessions[row] = session
        return row

    def take(self, row: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Row ``row``'s positions in order, {layer: (keys, values)} each (1, kv_heads, n,
        head_dim) and its own copy; the row is freed."""
        cols = self.valid[row].nonzero().squeeze(1)  # (n,)
        out = {i: (self.keys[i][row:row + 1].index_select(2, cols), self.values[i][row:row + 1].index_select(2, cols))
               for i in self.keys}
        self.free(row)
        return out

    def free(self, row: int) -> None:
        self.sessions[row] = None
        self.valid[row] = False

    def row_bytes(self) -> int:
        """Bytes one row occupies (every layer's keys and values, free columns included); safe
        to ask from another thread (metrics)."""
        valid = self.valid
        return 0 if valid is None else valid.shape[1] * self.column_bytes

    # -- one forward pass over rows lo..hi ------------------------------------------------

    def step_cache(self, lo: int, hi: int) -> "RowsStep":
        """The cache a forward pass over rows lo..hi reads and appends to (one new column)."""
        if self.width + 1 > self.valid.shape[1]:
            held = int(self.valid.sum(1).max())
            pack = 2 * (held + 1) <= self.width  # holes are most of the width: pack rather than grow
            self._rebuild(len(self.sessions), spare(held if pack else self.width), pack)
        return RowsStep(self, lo, hi, self.width)

    def mask(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (hi - lo, 1, 1, width + 1) for one new position per row: a row sees
        its own positions and its new one. Finite, not -inf, so no softmax row is all -inf."""
        keep = torch.ones((hi - lo, self.width + 1), dtype=torch.bool, device=self.valid.device)
        keep[:, :self.width] = self.valid[lo:hi, :self.width]
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None, None]

    def advance(self, stepped: list[int]) -> None:
        """After a pass: the new column holds a position of each row in ``stepped`` (not of dummies)."""
        self.valid[stepped, self.width] = True
        self.width += 1

    # -- storage --------------------------------------------------------------------------

    def _allocate(self, like: torch.Tensor, rows: int, columns: int) -> None:
        shape = (rows, like.shape[1], columns, like.shape[-1])
        for i in range(self.start, self.end + 1):
            self.keys[i] = like.new_zeros(shape)
            self.values[i] = like.new_zeros(shape)
        self.column_bytes = 2 * (self.end - self.start + 1) * like.shape[1] * like.shape[-1] * like.element_size()
        self.valid = torch.zeros((rows, columns), dtype=torch.bool, device=like.device)
        self.sessions += [None] * (rows - len(self.sessions))

    def _free_row(self) -> int:
        if None not in self.sessions:
            self._rebuild(2 * len(self.sessions), self.valid.shape[1], pack=False)
        return self.sessions.index(None)

    def _rebuild(self, rows: int, columns: int, pack: bool) -> None:
        """New buffers of ``rows`` x ``columns``: rows keep their columns, or with ``pack``
        their positions move to the front of the row in order."""
        keys, values, valid = dict(self.keys), dict(self.values), self.valid
        sessions = self.sessions
        self.sessions = []
        self._allocate(keys[self.start], rows, columns)
        self.sessions[:len(sessions)] = sessions
        if pack:
            for r, session in enumerate(sessions):
                if session is not None:
                    cols = valid[r].nonzero().squeeze(1)
                    for i in keys:
                        self.keys[i][r, :, :len(cols)] = keys[i][r].index_select(1, cols)
                        self.values[i][r, :, :len(cols)] = values[i][r].index_select(1, cols)
                    self.valid[r, :len(cols)] = True
            self.width = int(self.valid.sum(1).max())
            return
        n, w = len(sessions), self.width
        for i in keys:
            self.keys[i][:n, :, :w] = keys[i][:, :, :w]
            self.values[i][:n, :, :w] = values[i][:, :, :w]
        self.valid[:n, :w] = valid[:, :w]


class RowsStep:
    """What the layers of one pass over rows lo..hi see as their cache: ``update`` writes the
    new position (one per row) into column ``column`` and returns rows lo..hi up to it, in place."""

    def __init__(self, group: RowGroup, lo: int, hi: int, column: int):
        self.group, self.lo, self.hi, self.column = group, lo, hi, column

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: (hi - lo, kv_heads, 1, head_dim)."""
        keys, values = self.group.keys[layer_idx], self.group.values[layer_idx]
        lo, hi, c = self.lo, self.hi, self.column
        keys[lo:hi, :, c] = key_states[:, :, 0]
        values[lo:hi, :, c] = value_states[:, :, 0]
        return keys[lo:hi, :, :c + 1], values[lo:hi, :, :c + 1]
