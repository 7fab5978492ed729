"""A session's own KV cache, grown in place.

transformers' ``DynamicLayer`` appends by concatenation: every step copies the whole
cache of the layer into a new tensor, so a decode step's cost grows with the context it
holds. A ``GrowingLayer`` keeps its positions in a buffer with room to spare and writes
new ones in place; ``keys`` and ``values`` are views of the filled part, so everything
that reads a ``DynamicLayer`` (masks, attention, ``crop``) reads it unchanged. The buffer
is reallocated only when full, half as large again, so a session's appends copy each
position a bounded number of times over its life. On a CPU it lies in memory the OS maps as
it is written (``fabric.compute.kv.mapped``), so it reserves far ahead and grows seldom.

A sliding-window layer's queries see only the last ``window`` positions, their own
included. A ``WindowLayer`` keeps the last ``window - 1 + SLACK`` positions: what the next
query needs, and SLACK more so that the KV of an ended session can serve a later request
that shares a prefix a little shorter than all of it (a follow-up turn that tokenizes the
last few tokens of the previous answer differently). It appends in place into a buffer
with ROOM positions to spare and shifts its positions to the buffer's front once the room
is used, so a session's memory for the layer stays under ``window - 1 + SLACK + ROOM``
positions however long it runs. It reports the same mask sizes as transformers'
``DynamicSlidingWindowLayer`` and hands the attention the same keys, so the masks and the
results are those of a cold run. This module imports transformers: the executor imports it
where it builds caches.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .kv import mapped, reserve, room

SLACK = 64  # positions a sliding-window layer keeps beyond what its next query needs: the most a reuse cuts back
ROOM = 64  # positions of room a sliding-window layer's buffer has beyond those it keeps


class GrowingLayer(DynamicLayer):
    """A full-attention layer's KV, (batch, kv_heads, positions, head_dim), appended in place."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._keys: torch.Tensor | None = None  # the buffer; ``keys`` is its filled part
        self._values: torch.Tensor | None = None
        self.mapped = False  # the buffers lie in memory the OS maps as they fill (``kv.mapped``)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        self._room(n + q, key_states, value_states)
        self._keys[:, :, n:n + q] = key_states
        self._values[:, :, n:n + q] = value_states
        self.keys, self.values = self._keys[:, :, :n + q], self._values[:, :, :n + q]
        return self.keys, self.values

    def make_room(self, q: int) -> int:
        """Room for ``q`` more positions, as ``update`` makes it; returns the positions held."""
        n = self.get_seq_length()
        self._room(n + q, self._keys, self._values)
        return n

    def _room(self, positions: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        """A buffer of at least ``positions`` (grown with room to spare, shaped like ``like_*``)."""
        if self._keys is None or positions > self._keys.shape[-2]:
            self._grow(room(positions, 0 if self._keys is None else self._keys.shape[-2]), like_keys, like_values)

    @staticmethod
    def appending(layers: list[GrowingLayer]) -> tuple | None:
        """Where a decode pass that writes one new position into each of ``layers`` (one session's,
        alike in positions and room) puts it, in ``fabric.compute.decode_pass``'s terms: (keys,
        values, lines, first, width, extend), the buffers (1, kv_heads, room, head_dim), the line
        of each head's new key in a buffer seen as (lines, head_dim), 0, the positions attention
        then reads, and extend() to call once they are written. None where the layers differ."""
        held = {layer.make_room(1) for layer in layers}
        shapes = {layer._keys.shape for layer in layers}
        if len(held) != 1 or len(shapes) != 1:
            return None
        n, (_, heads, size, _) = held.pop(), shapes.pop()

        def extend() -> None:
            for layer in layers:
                layer.keys, layer.values = layer._keys[:, :, :n + 1], layer._values[:, :, :n + 1]

        lines = torch.arange(heads) * size + n
        return [layer._keys for layer in layers], [layer._values for layer in layers], lines, 0, n + 1, extend

    def _grow(self, size: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = self.get_seq_length()
        keys, values = self._buffers(size, key_states, value_states)
        if n:
            keys[:, :, :n] = self.keys
            values[:, :, :n] = self.values
        self._keys, self._values = keys, values

    def _buffers(self, size: int, like_keys: torch.Tensor,
                 like_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for ``size`` positions or more. On a CPU, both in one mapping the OS fills as they
        are written, reserved far ahead (``kv.reserve``): the room costs no memory, and a session
        grows them seldom (a growth copies every position inside a step). Elsewhere ``size``."""
        have = 0 if self._keys is None else self._keys.shape[-2]
        self.mapped = False
        if like_keys.device.type == "cpu" and like_keys.shape == like_values.shape and \
                like_keys.dtype == like_values.dtype:
            both, _ = mapped((2, *like_keys.shape[:2], reserve(size, have), like_keys.shape[-1]), like_keys)
            if both is not None:
                self.mapped = True
                return both[0], both[1]
        return (like_keys.new_empty((*like_keys.shape[:2], size, like_keys.shape[-1])),
                like_values.new_empty((*like_values.shape[:2], size, like_values.shape[-1])))

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys`` and ``values`` (batch, kv_heads, positions, head_dim), which nothing else
        writes, as the whole buffer: not copied, no room to spare (a row taken out of the batch
        group is copied once, not three times on its way to being kept)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._keys, self._values = self.keys, self.values = keys, values
        self.mapped = False

    def roll_back(self, pos: int) -> None:
        """Keep the first ``pos`` positions: the rest is forgotten where it lies (views shrink, nothing is copied)."""
        self.keys, self.values = self._keys[:, :, :pos], self._values[:, :, :pos]

    def trim(self) -> None:
        """Give back the room to spare: the buffer becomes exactly the filled part."""
        if self._keys is not None and self._keys.shape[-2] != self.get_seq_length():
            self._keys, self._values = self.keys.clone(), self.values.clone()  # on the heap, exact
            self.keys, self.values = self._keys, self._values
            self.mapped = False

    def reset(self) -> None:
        self._keys = self._values = None
        self.mapped = False
        super().reset()

    def nbytes(self) -> int:
        """Bytes this layer holds: room to spare included, unless the OS maps it only as it fills."""
        if self._keys is None:
            return 0
        held = self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()
        return held * self.get_seq_length() // self._keys.shape[-2] if self.mapped else held


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer's KV, (batch, kv_heads, positions, head_dim): its last
    ``keep`` positions, ``first`` the absolute position of the first of them, appended in
    place. ``cumulative_length`` (``get_seq_length``) counts every position the session has
    seen, as in transformers' sliding layer; the kept ones are ``first..cumulative_length - 1``."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window)
        self.keep = sliding_window - 1 + SLACK  # positions kept at most
        self.first = 0
        self._keys: torch.Tensor | None = None  # the buffer; ``keys`` is its filled part
        self._values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key_states, value_states (batch, kv_heads, q, head_dim); returns what the
        q queries attend to: the last ``window - 1`` positions before them (fewer at the start)
        and theirs, the keys ``get_mask_sizes`` announced to the mask."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.cumulative_length - self.first, key_states.shape[-2]
        seen = min(self.cumulative_length, self.sliding_window - 1)  # kept positions the queries see (<= n)
        self.cumulative_length += q
        if self._keys is not None and n + q <= self._keys.shape[-2]:  # room left: in place
            self._keys[:, :, n:n + q] = key_states
            self._values[:, :, n:n + q] = value_states
            self._fill(n + q)
            return self._keys[:, :, n - seen:n + q], self._values[:, :, n - seen:n + q]
        keys, values = key_states, value_states  # (batch, kv_heads, n + q, head_dim) once the kept join
        if n:
            keys, values = torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
        self._hold(keys, values, room(n + q, 0 if self._keys is None else self._keys.shape[-2]))
        return keys[:, :, n - seen:], values[:, :, n - seen:]

    def _hold(self, keys: torch.Tensor, values: torch.Tensor, size: int) -> None:
        """Keep the last ``keep`` of ``keys``, ``values`` (the positions up to
        ``cumulative_length``) in a new buffer of ``size`` positions, ROOM beyond ``keep`` at most."""
        kept = min(keys.shape[-2], self.keep)
        size = max(kept, min(size, self.keep + ROOM))
        self._keys = keys.new_empty((*keys.shape[:2], size, keys.shape[-1]))
        self._values = values.new_empty((*values.shape[:2], size, values.shape[-1]))
        self._keys[:, :, :kept] = keys[:, :, keys.shape[-2] - kept:]
        self._values[:, :, :kept] = values[:, :, values.shape[-2] - kept:]
        self.first = self.cumulative_length - kept
        self._fill(kept)

    def _fill(self, n: int) -> None:
        self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]

    def serves(self, pos: int) -> bool:
        """A session continuing at ``pos`` (<= cumulative_length) finds here every position its
        next query sees: pos - window + 1 .. pos - 1."""
        return self.first <= max(0, pos - self.sliding_window + 1) and pos <= self.cumulative_length

    def prefix(self, pos: int) -> "WindowLayer":
        """A new layer holding copies of the kept positions before ``pos`` (``serves(pos)`` true),
        as a session that ran ``pos`` positions would hold them."""
        out = WindowLayer(self.sliding_window)
        if pos:
            start = max(self.first, pos - self.keep) - self.first
            stop = pos - self.first
            out.lazy_initialization(self.keys, self.values)
            out.cumulative_length = pos
            out._hold(self.keys[:, :, start:stop], self.values[:, :, start:stop], stop - start)  # copied
        return out

    def roll_back(self, pos: int) -> None:
        """Forget the positions from ``pos`` on (``serves(pos)`` true), where they lie: nothing is copied."""
        self.cumulative_length = pos
        self._fill(pos - self.first)

    def trim(self) -> None:
        """Give back the room to spare: the buffer becomes exactly the last ``keep`` positions."""
        n = self.cumulative_length - self.first
        if self._keys is not None and self._keys.shape[-2] != min(n, self.keep):
            self._hold(self.keys, self.values, 0)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a WindowLayer is cut with prefix(), not cropped")

    def reset(self) -> None:
        self._keys = self._values = None
        self.first = 0
        super().reset()
        self.cumulative_length = 0

    def nbytes(self) -> int:
        """Bytes this layer holds, room to spare included."""
        if self._keys is None:
            return 0
        return self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()


OTHER = -1  # a layer neither grows nor slides: the library's own


def _window(layer) -> int | None:
    """A layer's sliding window: None for one that grows, OTHER for another kind."""
    if type(layer) is DynamicLayer:
        return None
    return layer.sliding_window if type(layer) is DynamicSlidingWindowLayer else OTHER


_WINDOWS: dict[int, tuple[object, list[int | None] | None]] = {}  # id(config): (config, each layer's window)


def new_cache(config) -> DynamicCache:
    """A DynamicCache for ``config``'s layers: full-attention layers grow in place,
    sliding-window ones keep a bounded tail of their positions. The kinds of layer are read
    from the config once (reading them took 0.4 ms a cache: one at every session's start and
    end); a config with a kind of layer of another sort gets the library's own each time."""
    known = _WINDOWS.get(id(config))
    if known is None or known[0] is not config:  # held, so its id is never another config's
        windows = [_window(layer) for layer in DynamicCache(config=config).layers]
        known = _WINDOWS[id(config)] = (config, None if OTHER in windows else windows)
    if known[1] is None:
        cache = DynamicCache(config=config)
        cache.layers = [_own(layer) for layer in cache.layers]
        return cache
    cache = DynamicCache()
    cache.layers = [GrowingLayer() if window is None else WindowLayer(window) for window in known[1]]
    cache.layer_class_to_replicate = None  # as the library's for a config: every layer is there
    return cache


def _own(layer):
    window = _window(layer)
    return GrowingLayer() if window is None else layer if window == OTHER else WindowLayer(window)


def trim(cache) -> None:
    """Give back every layer's room to spare (a cache kept, not appended to)."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, (GrowingLayer, WindowLayer)):
            layer.trim()


def roll_back(cache, start: int, end: int, pos: int) -> bool:
    """Cut layers start..end of ``cache`` back to their first ``pos`` positions, in place (the
    drafted positions a verification rejected); False, with nothing cut, where a layer cannot
    (a sliding-window layer that no longer holds what the next query sees, another kind)."""
    layers = [cache.layers[i] for i in range(start, end + 1)]
    if not all(isinstance(layer, GrowingLayer) or isinstance(layer, WindowLayer) and layer.serves(pos)
               for layer in layers):
        return False
    for layer in layers:
        layer.roll_back(pos)
    return True


def prefix(cache, config, start: int, end: int, pos: int) -> DynamicCache | None:
    """A new cache (``new_cache(config)``) holding copies of what ``cache``'s layers start..end
    held after their first ``pos`` positions; None where a sliding-window layer no longer
    holds a position the next query would see (it keeps its window and SLACK more)."""
    layers = cache.layers
    if not all(layers[i].serves(pos) for i in range(start, end + 1) if isinstance(layers[i], WindowLayer)):
        return None
    out = new_cache(config)
    for i in range(start, end + 1):
        layer = layers[i]
        if isinstance(layer, WindowLayer):
            out.layers[i] = layer.prefix(pos)
        else:
            out.update(layer.keys[:, :, :pos], layer.values[:, :, :pos], i)  # copied: (1, kv_heads, pos, head_dim)
    return out
