"""Attention whose result for a position does not depend on what it was computed beside. No sockets.

torch's fused CPU attention (``scaled_dot_product_attention``) splits queries and keys
into blocks whose sizes follow the call's shape, and rounds its partial results at each
block: one position computed in a prefill chunk of 64, in a re-prefill, in a one-token
step or in a decode batch of 8 comes out in different low bits. In bfloat16 those bits
reach the logits and, now and then, another token: the text after a failover changed.

``attention`` computes the same thing so that the arithmetic for a query row depends only on
that row, its keys and the head size. Its main path is a C kernel
(fabric/compute/kernels/attention.c, built on first use by ``fabric.compute.native``): every
row runs the same loops in the same order, on any thread, so it holds for any thread count
too, and it is faster than SDPA on a CPU (docs/BENCHMARKS.md). Where no C compiler is at
hand, ``_tiled`` does it in torch's operators, more slowly:

- scores: a matmul per tile of ``TILE`` keys (a kernel blocks its reduction by the length
  it is given), the queries of every head that shares a key head packed as the rows, padded
  with zeros to whole blocks of ``ROW_BLOCK`` (a kernel takes another path for one or two
  rows, or for a ragged last block);
- the softmax in float32: the maximum over every tile, each tile's sum, the tiles' sums
  added in order; masked keys exactly 0;
- values: a matmul per tile, the tiles added in order, where a tile past a query's keys
  adds an exact 0.

Either way a query gives the same bits in a chunk of any size, in a batch of any size, with
masked columns after its keys (the causal part of a chunk, a shorter row of a batch), on
one CPU: bit-equality across machines, or between the two paths, is not promised.
(``tests/test_invariant.py`` holds it in the default mode, and holds that
``scaled_dot_product_attention`` does not.)

A shard in bfloat16 on a CPU attends with it (``use_invariant``); float32 (exact mode)
and CUDA keep transformers' SDPA.
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from fabric.compute import native, splits

NAME = "meshnet_invariant"
ROW_BLOCK = 16  # the rows of a matmul come in whole blocks of this many
TILE = 256  # keys per matmul


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (b, heads, q, d); key and value (b, kv_heads, k, d); attention_mask boolean (True:
    attend) or additive, (b or 1, 1, q, k), or None (causal, the queries the last q keys).
    Returns (b, q, heads, d), as transformers' attention functions do."""
    kernel = native.library("attention")
    if kernel is not None:
        return _native(kernel, query, key, value, attention_mask, scaling, softcap), None
    return _tiled(query, key, value, attention_mask, scaling, softcap), None


def _tiled(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           scaling: float | None, softcap: float | None) -> torch.Tensor:
    """``attention`` in torch's own operators, where the C kernel cannot be built."""
    b, heads, q, d = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = groups * q  # a key head's query heads, each q positions
    packed = _whole_blocks(query.reshape(b, kv_heads, rows, d))
    tiles = range(0, k, TILE)
    scores = torch.cat([torch.matmul(packed, _tile(key, t).transpose(-1, -2)) for t in tiles], dim=-1)
    scores = scores[:, :, :rows].float() * (scaling if scaling is not None else d ** -0.5)  # (b, kv_heads, rows, k+)
    if softcap is not None:  # Gemma 2
        scores = torch.tanh(scores / softcap) * softcap
    keep = F.pad(_keep(attention_mask, q, k, query.device), (0, len(tiles) * TILE - k))  # (b or 1, 1, q, k+)
    scores = scores.view(b, kv_heads, groups, q, -1).masked_fill_(~keep[:, :, None], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top.clamp_min(torch.finfo(torch.float32).min))  # masked: exactly 0
    sums = weights.view(*weights.shape[:-1], len(tiles), TILE).sum(-1)  # (..., tiles): each sum over TILE keys
    probs = (weights / _in_order(sums.unbind(-1)).clamp_min(1e-30)[..., None]).to(value.dtype)
    probs = _whole_blocks(probs.view(b, kv_heads, rows, -1))
    out = _in_order([torch.matmul(probs[..., t:t + TILE], _tile(value, t)).float() for t in tiles])
    return out[:, :, :rows].to(value.dtype).reshape(b, heads, q, d).transpose(1, 2).contiguous()


class _Job(ctypes.Structure):
    """fabric/compute/kernels/attention.c's ``Job``."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("keep", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("sq", ctypes.c_int64 * 3), ("sk", ctypes.c_int64 * 3), ("sv", ctypes.c_int64 * 3),
                ("skeep", ctypes.c_int64 * 2),
                ("b", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("nq", ctypes.c_int),
                ("nk", ctypes.c_int), ("d", ctypes.c_int), ("fmt", ctypes.c_int),
                ("scale", ctypes.c_float), ("softcap", ctypes.c_float)]


_FORMATS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _native(kernel: ctypes.CDLL, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, scaling: float | None, softcap: float | None) -> torch.Tensor:
    """``attention`` by the C kernel: every row in one fixed order (fabric/compute/kernels/attention.c)."""
    return by_kernel(kernel, query, key, value, kernel_keep(attention_mask, query.shape[2], key.shape[2]),
                     scaling, softcap)


def kernel_keep(attention_mask: torch.Tensor | None, q: int, k: int) -> torch.Tensor | None:
    """The kernel's mask for ``attention_mask`` (as ``attention`` takes it) over q queries and
    k keys: boolean (b or 1, q, k), True where a query attends; None: causal, no mask."""
    if attention_mask is None:
        return None
    keep = _keep(attention_mask, q, k, attention_mask.device)[:, 0]
    return (keep if keep.stride(-1) == 1 else keep.contiguous()).expand(keep.shape[0], q, k)


def by_kernel(kernel: ctypes.CDLL, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              keep: torch.Tensor | None, scaling: float | None, softcap: float | None) -> torch.Tensor:
    """The C kernel over query (b, heads, q, d), key and value (b, kv_heads, k, d) and ``keep``
    (``kernel_keep``'s): (b, q, heads, d)."""
    b, heads, q, d = query.shape
    k = key.shape[2]
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    if key.dtype != query.dtype or value.dtype != query.dtype:  # a cast costs a dispatch even when a no-op
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = torch.empty(b, q, heads, d, dtype=query.dtype)
    job = _Job(query.data_ptr(), key.data_ptr(), value.data_ptr(), keep.data_ptr() if keep is not None else None,
               out.data_ptr(), query.stride()[:3], key.stride()[:3], value.stride()[:3],
               (keep.stride(0) if keep is not None and keep.shape[0] > 1 else 0, keep.stride(1) if keep is not None else 0),
               b, heads, key.shape[1], q, k, d, _FORMATS[query.dtype],
               scaling if scaling is not None else d ** -0.5, softcap or 0.0)
    shape = ("attention", b.bit_length(), heads, q.bit_length(), k.bit_length(), d)  # calls alike share a thread count
    call = functools.partial(kernel.meshnet_attention, ctypes.byref(job))  # (threads) -> rc
    if splits.run(shape, b * heads * q * k * d, torch.get_num_threads(), call):  # a decode step's is small
        raise MemoryError("attention: no memory for the scores")
    return out


def _whole_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (..., n, cols) with zero rows added to make whole blocks of ``ROW_BLOCK``."""
    extra = -x.shape[-2] % ROW_BLOCK
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def _tile(x: torch.Tensor, at: int) -> torch.Tensor:
    """Keys or values at..at + TILE of ``x`` (b, kv_heads, k, d), zeros past the end."""
    part = x[:, :, at:at + TILE]
    return F.pad(part, (0, 0, 0, TILE - part.shape[2])) if part.shape[2] < TILE else part


def _in_order(parts) -> torch.Tensor:
    """The sum of ``parts``, added first to last: a tile past a query's keys adds an exact 0."""
    total = None
    for part in parts:
        total = part if total is None else total + part
    return total


def _keep(mask: torch.Tensor | None, q: int, k: int, device) -> torch.Tensor:
    """Which keys each query attends to, boolean (b or 1, 1, q, k)."""
    if mask is None:
        keys = torch.arange(k, device=device)
        return (keys[None, :] <= keys[-q:, None])[None, None]  # causal; every key for a single query
    if mask.dtype == torch.bool:
        return mask[..., :k]
    return mask[..., :k] > torch.finfo(mask.dtype).min / 2  # additive: 0 attend, the dtype's minimum not


def use_invariant(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a shard attends with ``attention``: bfloat16 or float16 on a CPU."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


AttentionInterface.register(NAME, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
