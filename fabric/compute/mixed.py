"""Decode rows and a prompt's chunk in one forward pass. No sockets.

A prefill slice run as a pass of its own reads every weight of the layers again, as a
decode step does: on a CPU that is most of a small slice's cost. Run inside the decode
batch's pass, it pays only for its own tokens. The pass lays its tokens out in one
sequence (1, n + q, hidden): first one token for each of the n decode rows of the batch
group, then the chunk's q tokens. Projections, norms and MLPs are per token and take the
sequence as it is. Attention is not: the layers' cache and attention are swapped, for the
pass, for ``ChunkAndRows`` (each layer's new keys and values go to the group's rows and to
the chunk's own cache) and ``attention`` (transformers' own SDPA attention, once over the
rows as a decode batch and once over the chunk with its causal mask). Each part is
computed as it is alone; only the sequence the projections see is longer.

This module imports transformers; the executor imports it for a mixed pass.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "meshnet_rows_and_chunk"


class ChunkAndRows:
    """The cache of a mixed pass: ``rows`` (a ``RowsStep`` over n rows) and ``chunk`` (the
    chunk session's own cache)."""

    def __init__(self, rows, chunk, n: int):
        self.rows, self.chunk, self.n = rows, chunk, n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: (1, kv_heads, n + q, head_dim). Returns pairs (rows', chunk's)."""
        n = self.n
        rows = self.rows.update(key_states[0, :, :n, None].transpose(0, 1), value_states[0, :, :n, None].transpose(0, 1),
                                layer_idx)  # (n, kv_heads, 1, head_dim) in, (n, kv_heads, columns, head_dim) out
        chunk = self.chunk.update(key_states[:, :, n:], value_states[:, :, n:], layer_idx)
        return (rows[0], chunk[0]), (rows[1], chunk[1])


def attention(module, query: torch.Tensor, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, heads, n + q, head_dim); key, value and attention_mask: pairs (rows', chunk's).
    Returns (1, n + q, heads, head_dim), as every attention function of transformers does."""
    (rows_k, chunk_k), (rows_v, chunk_v), (rows_mask, chunk_mask) = key, value, attention_mask
    n = rows_k.shape[0]
    rows_q = query[0, :, :n, None].transpose(0, 1)  # (n, heads, 1, head_dim)
    rows_out, _ = sdpa_attention_forward(module, rows_q, rows_k, rows_v, rows_mask, **kwargs)  # (n, 1, heads, d)
    chunk_out, _ = sdpa_attention_forward(module, query[:, :, n:], chunk_k, chunk_v, chunk_mask, **kwargs)
    return torch.cat([rows_out.transpose(0, 1), chunk_out], dim=1), None


AttentionInterface.register(NAME, attention)


@contextlib.contextmanager
def rows_and_chunk(config):
    """The layers built on ``config`` attend with ``attention`` meanwhile."""
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
