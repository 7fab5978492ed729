"""Linears held as their GGUF file holds them (Q5_0, Q5_1, Q5_K, Q8_0), run by our own kernel.

torch has no kernel for a 5-bit grid, and its int8 kernel keeps one scale per output row, not
one per block of 32: re-rounded onto it, a Q5_* linear takes 1.45 times the file's bytes and no
longer holds the file's weights. :class:`BlockLinear` keeps the file's codes and block
parameters (5-bit codes as nibbles plus a bit plane; Q8_0's int8 codes; float16 steps and
minima; Q5_K's float16 d and dmin per 256 inputs with its 6-bit multipliers per block), about
1.0x the file's bytes, and multiplies with fabric/compute/kernels/qmatmul.c: every weight it
multiplies by is the file's own float32 weight, and a row's output is the same bits in any
batch and on any thread count (the kernel's comment says how).

Where the kernel cannot be built (no C compiler, ``MESHNET_NATIVE=0``) these types stay on
torch's int8 kernel, re-rounded, as before the kernel existed (``fabric.compute.gguf_grid``
warns once): that keeps the default mode batch-invariant and fast, at 1.45x the file's memory.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import native, splits

BLOCK = 32
SUPER = 256  # Q5_K's super-block
KINDS = {"Q5_0": 0, "Q5_1": 1, "Q5_K": 2, "Q8_0": 3}  # fabric/compute/kernels/qmatmul.c's enum
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # per 32 inputs; Q5_K: 176 per 256
_FORMATS = {torch.bfloat16: 0, torch.float32: 2}


@dataclass(frozen=True)
class FileBlocks:
    """A linear's weight in the kernel's layout, rows as the model orders them."""

    kind: str  # a key of KINDS
    shape: tuple[int, int]  # (out, in)
    codes: torch.Tensor  # 5-bit: (out, in / 2) uint8 nibbles (byte j: inputs j and j + 16); Q8_0: (out, in) int8
    high: torch.Tensor | None  # 5-bit: (out, in / 32) int32, bit i the fifth bit of the block's input i
    d: torch.Tensor  # (out, in / 32) float16 steps, as int16 bits; Q5_K: (out, in / 256, 2) d and dmin
    m: torch.Tensor | None  # Q5_1: (out, in / 32) float16 minima, as int16 bits
    sm: torch.Tensor | None  # Q5_K: (out, in / 32, 2) uint8 6-bit sc and m

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in (("codes", self.codes), ("high", self.high), ("d", self.d), ("m", self.m),
                                  ("sm", self.sm)) if v is not None}


def blocks_from_raw(raw: np.ndarray, type_name: str) -> FileBlocks:
    """The kernel's layout of a tensor's raw bytes (rows, bytes per row) of ``type_name``."""
    rows = raw.shape[0]
    raw = np.ascontiguousarray(raw).reshape(rows, -1).view(np.uint8)
    if type_name == "Q5_K":
        return _q5_k(raw)
    size = BLOCK_BYTES[type_name]
    blocks = raw.reshape(rows, -1, size)  # (rows, blocks, bytes)
    n = blocks.shape[1] * BLOCK
    d = _f16(blocks[..., 0:2])
    if type_name == "Q8_0":
        codes = blocks[..., 2:].reshape(rows, n).view(np.int8)
        return FileBlocks(type_name, (rows, n), _t(codes), None, d, None, None)
    at = 4 if type_name == "Q5_1" else 2
    m = _f16(blocks[..., 2:4]) if type_name == "Q5_1" else None
    high = _t(blocks[..., at:at + 4].copy().view(np.int32)[..., 0])  # Q5_0's own layout: the kernel's
    return FileBlocks(type_name, (rows, n), _t(blocks[..., at + 4:].reshape(rows, n // 2)), high, d, m, None)


def _q5_k(raw: np.ndarray) -> FileBlocks:
    """Q5_K's 176-byte super-blocks (d, dmin, 12 bytes of 6-bit sc and m, 32 of fifth bits,
    128 of nibbles) in the kernel's layout."""
    rows = raw.shape[0]
    sup = raw.reshape(rows, -1, 176)
    n = sup.shape[1] * SUPER
    sc, m = scale_min_k4(sup[..., 4:16])  # (rows, supers, 8) each
    qh, qs = sup[..., 16:48], sup[..., 48:176].reshape(rows, -1, 4, 1, 32)  # block pairs share their bytes
    low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15  # (rows, supers, 4, 2, 32)
    fifth = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1  # (rows, supers, 8, 32)
    codes = low.reshape(rows, -1, 8, 32) | (fifth << 4)
    nib, high = _packed5(codes.reshape(rows, -1, 32))
    d = np.ascontiguousarray(sup[..., 0:4]).view(np.int16).reshape(rows, -1, 2)  # float16 bits
    sm = np.stack([sc, m], -1).reshape(rows, -1, 2).astype(np.uint8)
    return FileBlocks("Q5_K", (rows, n), _t(nib.reshape(rows, n // 2)), _t(high), _t(d), None, _t(sm))


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``get_scale_min_k4`` for all 8 blocks of a Q4_K / Q5_K super-block: 12
    bytes -> eight 6-bit scales and eight 6-bit mins."""
    s = scales.astype(np.uint8)
    lo, hi = s[..., 0:4], s[..., 4:8]
    tail = s[..., 8:12]
    sc = np.concatenate([lo & 63, (tail & 0xF) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, m


def _packed5(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes (rows, blocks, 32) in 0..31 as nibbles (rows, blocks, 16) and fifth bits (rows, blocks) int32."""
    nib = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
    bits = ((codes >> 4).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)
    return nib.astype(np.uint8), bits.view(np.int32)


def _f16(two_bytes: np.ndarray) -> torch.Tensor:
    """float16 values as their int16 bits: a module's ``.to(dtype)`` casts float parameters, never these."""
    return _t(np.ascontiguousarray(two_bytes).view(np.int16)[..., 0])


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


class _QJob(ctypes.Structure):
    """fabric/compute/kernels/qmatmul.c's ``QJob``."""
    _fields_ = [("codes", ctypes.c_void_p), ("high", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("sm", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("in_", ctypes.c_int64), ("out", ctypes.c_int64),
                ("kind", ctypes.c_int), ("xfmt", ctypes.c_int), ("yfmt", ctypes.c_int)]


def kernel() -> ctypes.CDLL | None:
    """The built qmatmul kernel, or None where it cannot be had (``fabric.compute.native``)."""
    return native.library("qmatmul")


def _job(layer, x: torch.Tensor | None, y: torch.Tensor | None, rows: int) -> _QJob:
    ptr = (lambda t: None if t is None else t.data_ptr())
    return _QJob(ptr(layer.codes), ptr(layer.high), ptr(layer.d), ptr(layer.m), ptr(layer.sm), ptr(x), ptr(y),
                 rows, layer.in_features, layer.out_features, KINDS[layer.kind],
                 _FORMATS.get(x.dtype, 2) if x is not None else 2, _FORMATS.get(y.dtype, 2) if y is not None else 2)


class BlockLinear(nn.Module):
    """``y = x @ W.T + bias`` with W as the file stores it (:class:`FileBlocks`), computed in
    float32 by fabric/compute/kernels/qmatmul.c and returned in x's dtype (bfloat16 or float32;
    others go through float32). Every stored tensor is a frozen parameter, so
    ``ShardWeights.parameter_bytes()`` counts it."""

    def __init__(self, blocks: FileBlocks, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind = blocks.kind
        self.out_features, self.in_features = blocks.shape
        for name in ("codes", "high", "d", "m", "sm"):
            t = getattr(blocks, name)
            setattr(self, name, None if t is None else nn.Parameter(t.contiguous(), requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self._kernel = kernel()
        if self._kernel is None:
            raise RuntimeError("the qmatmul kernel cannot be built here: keep these weights on int8")
        self._job, self._at = None, None  # the weights' part of the kernel's job, built once
        self._shape = ("qmatmul", self.kind, self.in_features, self.out_features)  # calls alike share a thread count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (rows, in)
        if x2.dtype not in _FORMATS:
            x2 = x2.float()
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=x2.dtype)  # (rows, out)
        if x2.shape[0]:
            job = self._job_for(x2, y)
            work = x2.shape[0] * self.in_features * self.out_features
            call = functools.partial(self._kernel.meshnet_qmatmul, ctypes.byref(job))  # (threads) -> rc
            if splits.run((self._shape, x2.shape[0].bit_length()), work, torch.get_num_threads(), call):
                raise MemoryError("qmatmul: no memory for its working rows")
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _job_for(self, x: torch.Tensor, y: torch.Tensor) -> _QJob:
        """The kernel's job for rows ``x`` into ``y``: the weights' pointers are kept from the
        last call while the weights stay where they were (a Python call costs as much as a
        small matmul)."""
        if self._job is None or self._at != self.codes.data_ptr():
            self._job, self._at = _job(self, None, None, 0), self.codes.data_ptr()
        job = self._job
        job.x, job.y, job.rows = x.data_ptr(), y.data_ptr(), x.shape[0]
        job.xfmt, job.yfmt = _FORMATS[x.dtype], _FORMATS[y.dtype]
        return job

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (out, in) the kernel multiplies by (for checks)."""
        return file_weights(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.kind} as the file stores it")


def file_weights(layer) -> torch.Tensor:
    """The float32 weights (out, in) of a :class:`BlockLinear` or :class:`FileBlocks`, as the kernel computes them."""
    lib = kernel()
    out, n = (layer.out_features, layer.in_features) if isinstance(layer, BlockLinear) else layer.shape
    holder = layer if isinstance(layer, BlockLinear) else _Holder(layer)
    w = torch.empty(out, n, dtype=torch.float32)
    lib.meshnet_qweights(ctypes.byref(_job(holder, None, None, 0)), ctypes.c_int64(0), ctypes.c_int64(out),
                         ctypes.c_void_p(w.data_ptr()))
    return w


class _Holder:
    """A FileBlocks seen as the kernel's job sees a BlockLinear."""

    def __init__(self, blocks: FileBlocks):
        self.kind, (self.out_features, self.in_features) = blocks.kind, blocks.shape
        self.codes, self.high, self.d, self.m, self.sm = blocks.codes, blocks.high, blocks.d, blocks.m, blocks.sm
