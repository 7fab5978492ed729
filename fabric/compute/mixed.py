"""Decode rows and prompts' chunks in one forward pass. No sockets.

A prefill slice run as a pass of its own reads every weight of the layers again, as a
decode step does: on a CPU that is most of a small slice's cost. Run inside the decode
batch's pass, it pays only for its own tokens. The pass lays its tokens out in one
sequence (1, n + q..., hidden): first one token for each of the n decode rows of the batch
group, then each chunk's q tokens (a slice of a long prompt, or a few short whole ones).
Projections, norms and MLPs are per token and take the sequence as it is. Attention is
not: the layers' cache and attention are swapped, for the pass, for ``ChunksAndRows``
(each layer's new keys and values go to the group's rows and to each chunk's own cache)
and ``attention`` (the shard's own attention, SDPA or fabric/compute/attention.py, once
over the rows as a decode batch and once over each chunk with its causal mask). Each part is computed as it is alone; only
the sequence the projections see is longer.

This module imports transformers; the executor imports it for a mixed pass.
"""
from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import attention as invariant

NAME = "meshnet_rows_and_chunk"
INNER: ContextVar = ContextVar("inner", default=sdpa_attention_forward)  # how each part attends


class ChunksAndRows:
    """The cache of a mixed pass: ``rows`` (a ``RowsStep`` over n rows, or None: no rows), then
    each chunk's own cache and its number of positions."""

    def __init__(self, rows, chunks: list, sizes: list[int]):
        self.rows, self.chunks, self.sizes = rows, chunks, sizes

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: (1, kv_heads, n + q..., head_dim). Returns lists, the
        rows' (n, kv_heads, columns, head_dim) first, then each chunk's (1, kv_heads, pos + q, head_dim)."""
        n = key_states.shape[2] - sum(self.sizes)
        keys, values = [None], [None]
        if self.rows is not None:
            keys[0], values[0] = self.rows.update(key_states[0, :, :n, None].transpose(0, 1),
                                                  value_states[0, :, :n, None].transpose(0, 1), layer_idx)
        for cache, at, q in zip(self.chunks, self._starts(n), self.sizes):
            k, v = cache.update(key_states[:, :, at:at + q], value_states[:, :, at:at + q], layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values

    def _starts(self, n: int) -> list[int]:
        starts = [n]
        for q in self.sizes[:-1]:
            starts.append(starts[-1] + q)
        return starts


def attention(module, query: torch.Tensor, key, value, attention_mask, inner=None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, n + q..., head_dim); key and value: the rows' (None: no rows), then
    each chunk's; attention_mask: (the rows' mask, [(q, mask) of each chunk]). Returns (1,
    n + q..., heads, head_dim), as every attention function of transformers does. ``inner``:
    how each part attends (default ``INNER``'s)."""
    rows_mask, chunks = attention_mask
    inner = inner or INNER.get()
    n = key[0].shape[0] if key[0] is not None else 0
    out = []
    if n:
        rows_q = query[0, :, :n, None].transpose(0, 1)  # (n, heads, 1, head_dim)
        out.append(inner(module, rows_q, key[0], value[0], rows_mask, **kwargs)[0].transpose(0, 1))
    at = n
    for k, v, (q, mask) in zip(key[1:], value[1:], chunks):
        out.append(inner(module, query[:, :, at:at + q], k, v, mask, **kwargs)[0])
        at += q
    return torch.cat(out, dim=1), None


AttentionInterface.register(NAME, attention)


def _eager(module, *args, **kwargs):
    """The attention layer's own model's eager path (Gemma 2's, whose scores are capped: SDPA
    cannot cap them)."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


def _inner(name: str):
    """How a shard whose config names attention ``name`` attends."""
    if name == invariant.NAME:
        return invariant.attention
    return _eager if name == "eager" else ALL_ATTENTION_FUNCTIONS.get(name, sdpa_attention_forward)


@contextlib.contextmanager
def rows_and_chunks(config):
    """The layers built on ``config`` attend with ``attention`` meanwhile, each part as the
    shard attends otherwise (fabric/compute/attention.py, SDPA, or the model's eager path)."""
    before = config._attn_implementation
    token = INNER.set(_inner(before))
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
        INNER.reset(token)
