"""Sessions that decode together, their KV kept where the batch reads it. No sockets.

A ``RowGroup`` holds, for each layer of a span, one buffer (rows, kv_heads, columns,
head_dim), every layer's keys and values views of one tensor (so a row's move over every
layer is one copy, not one per layer and side): row r holds one session's positions, in
order, in its first ``lengths[r]`` columns. A decode step of the sessions in rows lo..hi is
one forward pass that reads rows lo..hi in place and writes each row's new position into
the column after its last, so a step copies nothing but the new keys and values. The rest
of a row is masked: the columns past a shorter row's end, and a row with no step in that
pass (it runs as a dummy: what it writes past its end is overwritten by its next real step).

A row's positions sit where a session's own cache keeps them, column = position, so
attention meets them in the same places either way (fabric/compute/attention.py sums
keys in fixed tiles of columns: the bits of a position do not depend on the batch).

KV moves only when the line-up changes: a session joins by copying its KV into a free row,
leaves by freeing the row (``take`` copies it out first where the session still needs it),
and the buffers are rebuilt when a row is full. On a CPU the buffers lie in memory the OS
maps as it is first written (``mapped``): the rows and columns nobody fills cost address space,
not memory, so the columns reach far ahead (``reserve``) and a rebuild, which stalls the
step of every session in the group, comes seldom; a freed row's pages go back.
"""
from __future__ import annotations

import mmap

import torch

from .kv import mapped, reserve, spare
from .lean_ops import put_lines

MIN_ROWS = 4  # rows allocated at least; more double


class RowGroup:
    """The KV of sessions decoding together over layers ``start..end``, one row each."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.sessions: list[str | None] = []  # per row; None: a free row
        self.kv: torch.Tensor | None = None  # (2, layers, rows, kv_heads, columns, head_dim): keys, values
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (rows, kv_heads, columns, head_dim), a view of kv
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: torch.Tensor | None = None  # (rows,) long: positions each row holds, from column 0
        self.columns = 0  # columns of the buffers
        self.column_bytes = 0  # bytes of one column of one row, over every layer's keys and values
        self.pages: mmap.mmap | None = None  # the memory of ``kv`` where the OS maps it on first touch

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
            self._allocate(k0, MIN_ROWS, n)
        row = self._free_row()
        if n >= self.columns:
            self._rebuild(len(self.sessions), n)
        for i, (k, v) in layers.items():
            self.keys[i][row, :, :n] = k[0]
            self.values[i][row, :, :n] = v[0]
        self.lengths[row] = n
        self.sessions[row] = session
        return row

    def take(self, row: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Row ``row``'s positions in order, {layer: (keys, values)} each (1, kv_heads, n,
        head_dim) and its own copy; the row is freed."""
        n = int(self.lengths[row])
        kv = self.kv[:, :, row:row + 1, :, :n].clone()  # one copy; each layer's pair views it
        self.free(row)
        return {i: (kv[0, i - self.start], kv[1, i - self.start]) for i in self.keys}

    def roll_back(self, row: int, pos: int) -> None:
        """Row ``row`` keeps its first ``pos`` positions; the columns past them are free again."""
        self.lengths[row] = pos

    def free(self, row: int) -> None:
        """Row ``row`` holds nobody; where the OS maps the buffer as it fills, the pages wholly inside
        the row go back to it (the next session in the row finds zeros there, stale values at the
        edges, as a row of the heap's holds: either way read only where masked)."""
        self.sessions[row] = None
        self.lengths[row] = 0
        if self.pages is not None:
            block = self.kv[0, 0, 0].numel() * self.kv.element_size()  # a row of one layer's keys (or values)
            page = mmap.PAGESIZE
            for side_layer in range(self.kv.shape[0] * self.kv.shape[1]):
                at = (side_layer * self.kv.shape[2] + row) * block
                lo, hi = -(-at // page) * page, (at + block) // page * page  # the pages wholly inside it
                if hi > lo:
                    self.pages.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def chunk(self, row: int, q: int) -> "RowChunk":
        """The cache of ``q`` positions that continue row ``row`` in place (a verification step
        of a session that decodes in the group): the buffers grow first if the row has no room."""
        end = int(self.lengths[row]) + q
        if end > self.columns:
            self._rebuild(len(self.sessions), end)
        return RowChunk(self, row, q)

    def row_bytes(self, row: int) -> int:
        """Bytes row ``row`` holds: its positions over every layer's keys and values, and its
        columns to spare unless the OS maps them only as they fill. Safe to ask from another
        thread (metrics)."""
        return (int(self.lengths[row]) if self.pages is not None else self.columns) * self.column_bytes

    def gathering(self, rows: list[int]) -> list[tuple[int, int]]:
        """Swaps of rows that bring ``rows`` side by side: into the window of as many rows
        that holds most of them already (the first such window)."""
        n, inside = len(rows), set(rows)
        start = max(range(len(self.sessions) - n + 1), key=lambda w: (len(inside.intersection(range(w, w + n))), -w))
        holes = [r for r in range(start, start + n) if r not in inside]
        return list(zip([r for r in rows if not start <= r < start + n], holes))

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` trade places: their positions, lengths and sessions."""
        n, there, back = int(max(self.lengths[a], self.lengths[b])), [a, b], [b, a]
        held = self.kv[:, :, a, :, :n].clone()  # plain slices: a tenth of an indexed copy's time
        self.kv[:, :, a, :, :n] = self.kv[:, :, b, :, :n]
        self.kv[:, :, b, :, :n] = held
        self.lengths[there] = self.lengths[back]
        self.sessions[a], self.sessions[b] = self.sessions[b], self.sessions[a]

    # -- one forward pass over rows lo..hi ------------------------------------------------

    def step_cache(self, lo: int, hi: int) -> "RowsStep":
        """The cache a forward pass over rows lo..hi reads and appends to (one new column each)."""
        longest = int(self.lengths[lo:hi].max())
        if longest + 1 > self.columns:
            self._rebuild(len(self.sessions), longest)
        return RowsStep(self, lo, hi, self.lengths[lo:hi].clone())

    def advance(self, stepped: list[int]) -> None:
        """After a pass: each row in ``stepped`` holds its new position (a dummy does not)."""
        self.lengths[stepped] += 1

    # -- storage --------------------------------------------------------------------------

    def _allocate(self, like: torch.Tensor, rows: int, n: int) -> None:
        """Zeroed buffers of ``rows`` rows with room for ``n`` positions and more. On a CPU the OS
        maps their pages as they fill (``mapped``), so the room reaches far ahead (``reserve``).
        Elsewhere, or where the OS refuses the mapping, half as many again as ``n`` (``spare``)."""
        def shape(columns: int) -> tuple[int, ...]:
            return 2, self.end - self.start + 1, rows, like.shape[1], columns, like.shape[-1]

        columns, self.kv, self.pages = spare(n), None, None
        if like.device.type == "cpu":
            far = reserve(n, self.columns)
            self.kv, self.pages = mapped(shape(far), like)
            columns = far if self.kv is not None else columns
        if self.kv is None:
            self.kv = like.new_zeros(shape(columns))
        for i in range(self.start, self.end + 1):
            self.keys[i], self.values[i] = self.kv[0, i - self.start], self.kv[1, i - self.start]
        self.column_bytes = 2 * (self.end - self.start + 1) * like.shape[1] * like.shape[-1] * like.element_size()
        self.lengths = torch.zeros(rows, dtype=torch.long, device=like.device)
        self.columns = columns
        self.sessions += [None] * (rows - len(self.sessions))

    def _free_row(self) -> int:
        if None not in self.sessions:
            self._rebuild(2 * len(self.sessions), int(self.lengths.max()))
        return self.sessions.index(None)

    def _rebuild(self, rows: int, n: int) -> None:
        """New buffers of ``rows`` rows with room for ``n`` positions and more; the rows keep theirs."""
        kv, lengths, sessions = self.kv, self.lengths, self.sessions
        self.sessions = []
        self._allocate(kv[0, 0], rows, n)
        self.sessions[:len(sessions)] = sessions
        for row, n in enumerate(lengths.tolist()):  # a row's filled columns only: the rest stays untouched
            if n:
                self.kv[:, :, row, :, :n] = kv[:, :, row, :, :n]
        self.lengths[:len(sessions)] = lengths


class RowsStep:
    """What the layers of one pass over rows lo..hi see as their cache: ``update`` writes each
    row's new position into the column after its last (``ends``) and returns rows lo..hi, in
    place; ``mask`` is the pass's attention mask."""

    def __init__(self, group: RowGroup, lo: int, hi: int, ends: torch.Tensor):
        self.group, self.lo, self.hi, self.ends = group, lo, hi, ends
        self.width = int(ends.max()) + 1
        _, heads, columns, _ = group.kv.shape[2:]  # every layer's buffer alike: where each new key goes,
        rows = torch.arange(lo, hi, device=ends.device)  # as a line of the buffer seen as (lines, head_dim)
        self.lines = ((rows[:, None] * heads + torch.arange(heads, device=ends.device)) * columns
                      + ends[:, None]).reshape(-1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: (hi - lo, kv_heads, 1, head_dim)."""
        keys, values = self.group.keys[layer_idx], self.group.values[layer_idx]
        if not put_lines(keys, values, self.lines, key_states, value_states):
            d = keys.shape[-1]  # one index_copy_ a side: under half an indexed assignment's time
            keys.view(-1, d).index_copy_(0, self.lines, key_states.reshape(-1, d))
            values.view(-1, d).index_copy_(0, self.lines, value_states.reshape(-1, d))
        return keys[self.lo:self.hi, :, :self.width], values[self.lo:self.hi, :, :self.width]

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (hi - lo, 1, 1, width) for one new position per row: a row sees its own
        positions and its new one. Finite, not -inf, so no softmax row is all -inf."""
        keep = torch.arange(self.width, device=self.ends.device)[None, :] <= self.ends[:, None]
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None, None]


class RowChunk:
    """What the layers of a pass see as the cache of ``q`` positions continuing row ``row``:
    ``update`` writes them into the columns after the row's last and returns the row up to
    them, in place (so the session stays in its row, and its next decode step batches with
    the others' without a copy in or out). The row's length moves on with ``done``."""

    def __init__(self, group: RowGroup, row: int, q: int):
        self.group, self.row, self.q = group, row, q
        self.at = int(group.lengths[row])  # the first of the chunk's columns (= its first position)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: (1, kv_heads, q, head_dim). Returns (1, kv_heads, at + q, head_dim)."""
        end = self.at + self.q
        keys, values = self.group.keys[layer_idx], self.group.values[layer_idx]
        keys[self.row, :, self.at:end] = key_states[0]
        values[self.row, :, self.at:end] = value_states[0]
        return keys[self.row:self.row + 1, :, :end], values[self.row:self.row + 1, :, :end]

    def mask(self) -> torch.Tensor:
        """Boolean (1, 1, q, at + q), True where a query attends: causal over the row's columns."""
        keys = torch.arange(self.at + self.q, device=self.group.lengths.device)
        queries = torch.arange(self.at, self.at + self.q, device=keys.device)
        return (keys[None, :] <= queries[:, None])[None, None]

    def done(self) -> None:
        """After the pass: the row holds the chunk's positions (a dummy step there wrote before them)."""
        self.group.lengths[self.row] = self.at + self.q
