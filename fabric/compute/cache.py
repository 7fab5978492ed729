"""A session's own KV cache, grown in place.

transformers' ``DynamicLayer`` appends by concatenation: every step copies the whole
cache of the layer into a new tensor, so a decode step's cost grows with the context it
holds. A ``GrowingLayer`` keeps its positions in a buffer with room to spare and writes
new ones in place; ``keys`` and ``values`` are views of the filled part, so everything
that reads a ``DynamicLayer`` (masks, attention, ``crop``) reads it unchanged. The buffer
is reallocated only when full, half as large again, so a session's appends copy each
position a bounded number of times over its life. Sliding-window layers keep their own
class (their window already bounds them). This module imports transformers: the executor
imports it where it builds caches.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .kv import room


class GrowingLayer(DynamicLayer):
    """A full-attention layer's KV, (batch, kv_heads, positions, head_dim), appended in place."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._keys: torch.Tensor | None = None  # the buffer; ``keys`` is its filled part
        self._values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        if self._keys is None or n + q > self._keys.shape[-2]:
            self._grow(room(n + q, 0 if self._keys is None else self._keys.shape[-2]), key_states, value_states)
        self._keys[:, :, n:n + q] = key_states
        self._values[:, :, n:n + q] = value_states
        self.keys, self.values = self._keys[:, :, :n + q], self._values[:, :, :n + q]
        return self.keys, self.values

    def _grow(self, size: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = self.get_seq_length()
        keys = key_states.new_empty((*key_states.shape[:2], size, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:2], size, value_states.shape[-1]))
        if n:
            keys[:, :, :n] = self.keys
            values[:, :, :n] = self.values
        self._keys, self._values = keys, values

    def trim(self) -> None:
        """Give back the room to spare: the buffer becomes exactly the filled part."""
        if self._keys is not None and self._keys.shape[-2] != self.get_seq_length():
            self._keys, self._values = self.keys.clone(), self.values.clone()
            self.keys, self.values = self._keys, self._values

    def reset(self) -> None:
        self._keys = self._values = None
        super().reset()

    def nbytes(self) -> int:
        """Bytes this layer holds, room to spare included."""
        if self._keys is None:
            return 0
        return self._keys.numel() * self._keys.element_size() + self._values.numel() * self._values.element_size()


def new_cache(config) -> DynamicCache:
    """A DynamicCache for ``config``'s layers whose full-attention layers grow in place."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def trim(cache) -> None:
    """Give back every growing layer's room to spare (a cache kept, not appended to)."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, GrowingLayer):
            layer.trim()

