"""A GGUF's own quantization grid, carried onto torch's weight-only kernels (``--quant auto``).

llama.cpp stores a weight in blocks of 32 along the input. Q4_1 keeps a float16 step ``d``
and minimum ``m`` per block, each weight ``m + q * d`` with q in 0..15; Q4_0 keeps ``d``
alone, each weight ``(q - 8) * d``; Q8_0 keeps ``d`` and int8 codes, ``q * d``. Q4_K groups
eight such 32-weight blocks into a super-block of 256 with a float16 ``d`` and ``dmin``, and
gives each block 6-bit multipliers ``sc`` and ``m``: each weight ``d * sc * q - dmin * m``.

- Q4_0, Q4_1 and Q4_K are the int4 kernel's own shape (``fabric.compute.quant.Int4Linear``:
  4-bit codes, groups of 32, ``(q - 8) * scale + zero``): scale the block's step (``d``, or
  Q4_K's ``d * sc``) and zero its minimum + 8 steps, with the file's codes. The one change
  is the kernel's bfloat16 scale and zero, rounded from the file's step and minimum
  (measured on SmolLM2-135M's Q4_1 layers: at most 0.09 of a step, 0.012 on average; no
  code moves).
- Q5_0, Q5_1 and Q5_K have no torch kernel: they keep the file's codes and block parameters
  and run on our own (``fabric.compute.qblock.BlockLinear``, fabric/compute/kernels/qmatmul.c),
  each weight the file's own float32 weight (:func:`blocks_of` checks it bit for bit at load).
  Where that kernel cannot be built they are re-rounded onto int8, as Q6_K and Q8_0 are.
- Q6_K and Q8_0: torch's int8 kernel keeps one scale per output row, not per block, so their
  weights are re-rounded onto their row's int8 grid (``Int8Linear.from_linear``): 255 levels a
  row, finer than the file's 64 or 255 a block unless a block's range is far below its row's.
  (Q8_0 on the qmatmul kernel is exact but measured slower than int8 at one row:
  docs/BENCHMARKS.md, "The qmatmul kernel".)
- Float tensors (F32, F16, BF16), and the types no kernel here holds (Q2_K, Q3_K, the IQ
  types), keep their float form (:data:`KEEP`): bfloat16 in the default mode.

:func:`grid_of` recovers a linear's grid from its dequantized float32 weight after
transformers' tensor processor has reordered its rows (llama.cpp permutes Q and K), by
passing each block's step and minimum through the same processor, and checks that every
weight is exactly ``minimum + code * step``; anything else keeps no grid.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from . import qblock
from .model_ref import BLOCK_TYPES, GRID_TYPES, OWN_GRID_TYPES
from .qblock import FileBlocks, scale_min_k4

log = logging.getLogger(__name__)

BLOCK = 32  # weights per llama.cpp block of Q4_0, Q4_1 and Q8_0 (and per Q4_K sub-block)
KEEP = "keep"  # a linear that stays in its float form (the model's dtype)


@dataclass(frozen=True)
class FileGrid:
    """A linear's weight as its GGUF stores it: ``weight = minimum + codes * scale`` per block."""

    codes: torch.Tensor  # (out, in) uint8, 0..15
    scale: torch.Tensor  # (out, in / 32) float32: each block's step (the file's float16)
    minimum: torch.Tensor  # (out, in / 32) float32: the weight of code 0 (Q4_1: m; Q4_0: -8 d)
    # Q4_K's factors, rows in the model's order: d and dmin (out, in / 256) float32 (the file's
    # float16), sc and m (out, in / 32) uint8; scale = d sc and minimum = -(dmin m), exactly
    factors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def weight(self) -> torch.Tensor:
        """The float32 weight (out, in) the file's blocks give (for checks)."""
        return (self.minimum.repeat_interleave(BLOCK, 1)
                + self.codes.float() * self.scale.repeat_interleave(BLOCK, 1))


def block_params(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(step, minimum), each (rows, blocks of 32) float32, of a Q4_0, Q4_1 or Q4_K tensor's
    raw bytes (rows, bytes per row); None for any other type."""
    if type_name == "Q4_K":
        return _q4_k_params(raw)
    if type_name not in ("Q4_0", "Q4_1"):
        return None
    size = 2 + (2 if type_name == "Q4_1" else 0) + BLOCK // 2  # float16 d, (float16 m,) 32 four-bit codes
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, size)  # (rows, blocks, bytes)
    step = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        minimum = -8 * step
    return step, minimum


def _q4_k_params(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's (step, minimum) per 32-weight block: ``d * sc`` and ``-dmin * m``, computed in
    float32 as llama.cpp (and gguf-py's dequantize) compute them."""
    return q4_k_steps(*q4_k_factors(raw))


def q4_k_steps(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step, minimum) per block of 32, ``d * sc`` and ``-(dmin * m)`` in float32, of Q4_K's
    factors (:func:`q4_k_factors`'s shapes)."""
    per = sc.shape[1] // d.shape[1]  # blocks a super-block
    return np.repeat(d, per, 1) * sc.astype(np.float32), -(np.repeat(dmin, per, 1) * m.astype(np.float32))


def q4_k_factors(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's d and dmin (rows, super-blocks) float32, sc and m (rows, blocks of 32) uint8."""
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, 144)  # (rows, supers, d dmin scales[12] qs[128])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, supers)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, m = scale_min_k4(blocks[..., 4:16])  # (rows, supers, 8) each
    return d, dmin, sc.reshape(raw.shape[0], -1).astype(np.uint8), m.reshape(raw.shape[0], -1).astype(np.uint8)


def placement_of(weight: np.ndarray, raw: np.ndarray, type_name: str, scheme: str,
                 process: Callable[[np.ndarray], np.ndarray | None]) -> FileGrid | FileBlocks | str | None:
    """Where a linear stored as ``type_name`` goes under ``scheme``: its :class:`FileGrid`
    (the int4 kernel with the file's codes), its :class:`FileBlocks` (the qmatmul kernel,
    Q5_* under ``gguf``), :data:`KEEP` (its float form), or None (the scheme's own kernel:
    int8 under ``gguf`` and ``int8``, a fitted int4 grid under ``int4``).

    ``gguf`` is each type on its own kernel (module docstring); ``int4`` keeps a 4-bit file
    grid and fits the rest; ``int8`` re-rounds everything. The lm_head is int8 under every
    scheme (``fabric.compute.quant.LM_HEAD_SCHEME``)."""
    if scheme == "gguf" and type_name not in OWN_GRID_TYPES:
        return KEEP
    if scheme == "gguf" and type_name in BLOCK_TYPES:
        return blocks_of(weight, raw, type_name, process)
    if scheme not in ("gguf", "int4") or type_name not in GRID_TYPES:
        return None
    return grid_of(weight, raw, type_name, process)


def grid_of(weight: np.ndarray, raw: np.ndarray, type_name: str,
            process: Callable[[np.ndarray], np.ndarray | None]) -> FileGrid | None:
    """The grid of a Q4_0 / Q4_1 / Q4_K linear whose processed float32 weight is ``weight`` (out, in).

    ``process`` is transformers' tensor processor for this tensor (a function of an array
    shaped as the file's dequantized tensor, returning it as the model holds it). None when
    the type has no 4-bit grid, the processor does more than reorder rows, or a weight is
    not on the grid."""
    params = block_params(raw, type_name)
    if params is None or weight.ndim != 2 or weight.shape[1] % BLOCK:
        return None
    step, minimum = (process(np.repeat(a, BLOCK, axis=1)) for a in params)  # as the weight's rows moved
    if step is None or minimum is None or step.shape != weight.shape or minimum.shape != weight.shape:
        return None
    step, minimum = step[:, ::BLOCK], minimum[:, ::BLOCK]  # (out, in / 32)
    w = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    s, m = torch.from_numpy(np.ascontiguousarray(step)), torch.from_numpy(np.ascontiguousarray(minimum))
    s_full, m_full = s.repeat_interleave(BLOCK, 1), m.repeat_interleave(BLOCK, 1)
    codes = torch.where(s_full == 0, 0.0, torch.round((w - m_full) / torch.where(s_full == 0, 1.0, s_full)))
    if codes.min() < 0 or codes.max() > 15:
        return None
    grid = FileGrid(codes.to(torch.uint8), s, m, _factors(raw, type_name, process, weight.shape))
    if not torch.equal(grid.weight(), w):
        return None  # not a pure reordering of the file's blocks
    return grid


def _factors(raw: np.ndarray, type_name: str, process: Callable[[np.ndarray], np.ndarray | None],
             shape: tuple[int, int]) -> tuple | None:
    """A Q4_K linear's factors (``FileGrid.factors``), rows in the model's order; None for
    other types, or where the processor does more than reorder rows. The order is read from a
    block's width of columns, not the whole weight's (a load's peak): ``pack_int4`` checks that
    the factors give the steps and minima, and packs those where they do not."""
    order = row_order(process, (shape[0], BLOCK)) if type_name == "Q4_K" else None
    return None if order is None else tuple(np.ascontiguousarray(a[order]) for a in q4_k_factors(raw))


def blocks_of(weight: np.ndarray, raw: np.ndarray, type_name: str,
              process: Callable[[np.ndarray], np.ndarray | None]) -> FileBlocks | None:
    """The file's blocks of a Q5_* linear whose processed float32 weight is ``weight`` (out, in),
    rows in the model's order, for the qmatmul kernel. None (the int8 kernel) where the kernel
    cannot be built (warned once), the processor does more than reorder rows, or the kernel's
    weights are not the file's, bit for bit."""
    if qblock.kernel() is None:
        _warn_no_kernel()
        return None
    if weight.ndim != 2 or weight.shape[1] % BLOCK:
        return None
    order = row_order(process, weight.shape)
    if order is None:
        return None
    blocks = qblock.blocks_from_raw(np.ascontiguousarray(raw)[order], type_name)
    exact = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    if blocks.shape != weight.shape or not torch.equal(qblock.file_weights(blocks), exact):
        return None
    return blocks


def row_order(process: Callable[[np.ndarray], np.ndarray | None], shape: tuple[int, int]) -> np.ndarray | None:
    """Which file row each of the model's rows is (``process`` reorders rows: llama.cpp's Q and
    K permutation undone), or None where it does anything else."""
    rows = process(np.broadcast_to(np.arange(shape[0], dtype=np.float32)[:, None], shape).copy())
    if rows is None or rows.shape != tuple(shape) or not (rows == rows[:, :1]).all():
        return None
    order = rows[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(shape[0])):
        return None
    return order


@functools.cache
def _warn_no_kernel() -> None:
    log.warning("the qmatmul kernel is not built here: %s weights are re-rounded onto int8 rows "
                "(1.45x the file's bytes, no longer the file's weights)", "/".join(sorted(BLOCK_TYPES)))
