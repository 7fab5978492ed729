"""Linears on our int8-activation kernel (fabric/compute/kernels/q8dot.c), llama.cpp's arithmetic.

torch's weight-only kernels multiply bfloat16 rows by dequantized weights; for a decode step
(a few rows) that streams the weights at ~5 GB/s on one thread. llama.cpp quantizes each
row to int8 per block of 32 and takes integer dot products (AVX-512 VNNI here, AVX2 or plain C
elsewhere): :class:`DotLinear` does the same with a GGUF's own 4-bit codes (Q4_0, Q4_1: the
file's step and minimum per block, float16 where that is exact, else float32; Q4_K: the file's
6-bit multipliers and its super-blocks' d and dmin, multiplied out in the kernel) or with
int8 codes (the lm_head's int8 rows and their scales, or Q8_0 blocks). Every row's output is
the same bits alone or in any batch, on any thread count (the kernel's comment says how).

A GGUF's default mode runs on it (``fabric.compute.quant.file_on_dot``) unless ``MESHNET_Q8DOT=0``
(read as a shard loads, :func:`enabled`) or there is no C compiler (``fabric.compute.native``):
then torch's kernels. An explicit ``--quant int8``/``int4`` of a float model stays on torch's.
The activations' int8 rounding is an approximation torch's path does not make, and llama.cpp
does: top-1 agreement with float32 0.951 against torch's 0.960-0.978, perplexity within 2%
(docs/BENCHMARKS.md, "The q8dot kernel"), for 1.3-1.7x the decode speed.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import numpy as np
import torch
from torch import nn

from . import native, splits

log = logging.getLogger(__name__)

BLOCK = 32
TILE = 16  # outputs a register holds; tiles are padded to it
KINDS = {"int4_f16": 0, "int4_f32": 1, "int8_row": 2, "q8_0": 3, "int4_k": 4}  # kernels/q8dot.c's enum
SUPER = 256  # inputs of a Q4_K super-block: one d and dmin a row
_FORMATS = {torch.bfloat16: 0, torch.float32: 2}


def enabled() -> bool:
    """True unless ``MESHNET_Q8DOT`` turns the kernel off, where native kernels are on."""
    off = os.environ.get("MESHNET_Q8DOT", "1").strip().lower() in ("0", "off", "false", "no")
    return not off and native.enabled()


PATHS = {2: "AVX-512 VNNI", 1: "AVX2", 0: "plain C"}  # kernels/q8dot.c's meshnet_q8dot_path()


def kernel() -> ctypes.CDLL | None:
    """The built q8dot kernel, or None where it cannot be had (``fabric.compute.native``)."""
    lib = native.library("q8dot")
    if lib is None:
        return None
    _said_path(lib.meshnet_q8dot_path())
    return declared(lib)


@functools.cache
def _said_path(path: int) -> None:
    """Say once which instructions the kernel was built for: on a CPU without AVX2 its plain C
    path is several times slower, and a user should hear why."""
    if path == 0:
        log.warning("the int8-activation kernel runs its plain C path (this CPU has no AVX2): decode is "
                    "several times slower than on an AVX2 CPU")
    else:
        log.info("the int8-activation kernel runs its %s path", PATHS.get(path, path))


def declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of kernels/q8dot.c) with the argument types of the calls made with Python
    ints and ctypes structures, set once for the library rather than by each caller."""
    lib.meshnet_q8dot_tile_bytes.restype = ctypes.c_int64
    lib.meshnet_q8dot_tile_bytes.argtypes = [ctypes.c_int, ctypes.c_int64]
    job = ctypes.POINTER(_DJob)
    lib.meshnet_q8dot_mlp.argtypes = [job, job, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.meshnet_q8dot_mlp.restype = ctypes.c_int
    lib.meshnet_q8dot_after_attention.argtypes = [job, ctypes.c_void_p, ctypes.POINTER(_NormArgs), job, job,
                                                  ctypes.c_void_p, ctypes.c_int * 3]
    lib.meshnet_q8dot_after_attention.restype = ctypes.c_int
    return lib


def wanted() -> bool:
    """The kernel asked for (:func:`enabled`) and built here."""
    return enabled() and kernel() is not None


class _DJob(ctypes.Structure):
    """kernels/q8dot.c's ``DJob``."""
    _fields_ = [("w", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("in_", ctypes.c_int64), ("out", ctypes.c_int64),
                ("kind", ctypes.c_int), ("xfmt", ctypes.c_int), ("yfmt", ctypes.c_int)]


def _tiled(a: np.ndarray, out: int) -> np.ndarray:
    """Rows (out, ...) padded with zeros to whole tiles: (tiles, 16, ...)."""
    pad = -out % TILE
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
    return a.reshape(-1, TILE, *a.shape[1:])


def _groups(codes: np.ndarray) -> np.ndarray:
    """Codes (out, in) uint8 as (tiles, blocks, 8 groups, 16 outputs, 4 inputs): a register per group."""
    out, n = codes.shape
    t = _tiled(codes, out).reshape(-1, TILE, n // BLOCK, 8, 4)  # (tiles, 16, blocks, groups, 4)
    return t.transpose(0, 2, 3, 1, 4)


def _per_block(values: np.ndarray, out: int) -> np.ndarray:
    """(out, blocks) values as (tiles, blocks, 16 * itemsize) bytes."""
    t = np.ascontiguousarray(_tiled(values, out).transpose(0, 2, 1))  # (tiles, blocks, 16)
    return t.view(np.uint8).reshape(t.shape[0], t.shape[1], -1)


def pack_int4(codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor,
              factors: tuple | None = None) -> tuple[str, torch.Tensor]:
    """4-bit codes (out, in) in 0..15 with a float32 step and minimum per (out, block of 32):
    w = minimum + code * step. Returns (kind, packed (tiles, tile bytes) uint8); the step and
    minimum are kept as Q4_K's ``factors`` where given (``FileGrid.factors``: 5.1 bits a weight
    in all, the file's 4.5), else as float16 where every one is exactly a float16, else as float32."""
    c = codes.numpy().astype(np.uint8)
    s, m = step.float().numpy(), minimum.float().numpy()
    if factors is not None and c.shape[1] % SUPER == 0 and _factored(s, m, factors):
        return "int4_k", _pack_int4_k(c, factors)
    exact = (np.array_equal(s.astype(np.float16).astype(np.float32), s)
             and np.array_equal(m.astype(np.float16).astype(np.float32), m))
    dtype, kind = (np.float16, "int4_f16") if exact else (np.float32, "int4_f32")
    blocks = _int4_blocks(c, s.astype(dtype), m.astype(dtype))
    return kind, torch.from_numpy(np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1)))


def _int4_blocks(codes: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Each block's packed 4-bit codes, then its 16 ``first`` and 16 ``second`` (out, blocks) values
    (steps and minima, or Q4_K's sc and m): (tiles, blocks, bytes)."""
    out = codes.shape[0]
    g = _groups(codes)  # (tiles, blocks, 8, 16, 4)
    nib = (g[:, :, :4] | (g[:, :, 4:] << 4)).reshape(g.shape[0], g.shape[1], -1)  # (tiles, blocks, 256)
    return np.concatenate([nib, _per_block(first, out), _per_block(second, out)], -1)


def _factored(step: np.ndarray, minimum: np.ndarray, factors: tuple) -> bool:
    """Whether Q4_K's ``factors`` give ``step`` and ``minimum`` exactly (as the kernel computes them)."""
    from .gguf_grid import q4_k_steps

    s, m = q4_k_steps(*factors)
    return np.array_equal(s, step) and np.array_equal(m, minimum)


def _pack_int4_k(codes: np.ndarray, factors: tuple) -> torch.Tensor:
    """kernels/q8dot.c's K4_K tiles: each super-block's 16 d and 16 -dmin, then its 8 blocks' codes,
    16 sc and 16 m, all float16 (the file's values, exact)."""
    d, dmin, sc, m = factors
    out = codes.shape[0]
    blocks = _int4_blocks(codes, sc.astype(np.float16), m.astype(np.float16))
    supers = np.concatenate([_per_block(d.astype(np.float16), out), _per_block((-dmin).astype(np.float16), out)], -1)
    tiles, nb = blocks.shape[:2]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(
        [supers, blocks.reshape(tiles, nb // (SUPER // BLOCK), -1)], -1).reshape(tiles, -1)))


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[str, torch.Tensor]:
    """int8 codes (out, in) and a step per output row (out,) or per (out, block of 32) (Q8_0,
    float16 steps): w = code * step. Returns (kind, packed (tiles, tile bytes) uint8)."""
    c = codes.numpy().view(np.int8)
    out = c.shape[0]
    g = _groups((c.astype(np.int16) + 128).astype(np.uint8))  # unsigned codes u = c + 128
    body = g.reshape(g.shape[0], g.shape[1], -1)  # (tiles, blocks, 512)
    if scales.dim() == 2:
        blocks = np.concatenate([body, _per_block(scales.numpy().astype(np.float16), out)], -1)
        return "q8_0", torch.from_numpy(np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1)))
    row = np.ascontiguousarray(_tiled(scales.float().numpy(), out)).view(np.uint8)  # (tiles, 64)
    return "int8_row", torch.from_numpy(np.concatenate([body.reshape(body.shape[0], -1), row], -1))


class DotLinear(nn.Module):
    """``y = x @ W.T + bias`` on kernels/q8dot.c: x's rows quantized to int8 per block of 32,
    W as :func:`pack_int4` / :func:`pack_int8` hold it; returned in x's dtype (bfloat16 or
    float32; others go through float32). ``packed`` is a frozen parameter, so
    ``ShardWeights.parameter_bytes()`` counts it."""

    def __init__(self, kind: str, packed: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self._kernel = kernel()
        if self._kernel is None:
            raise RuntimeError("the q8dot kernel cannot be built here: keep torch's kernels")
        if in_features % BLOCK or packed.shape[1] != self._kernel.meshnet_q8dot_tile_bytes(KINDS[kind], in_features):
            raise ValueError(f"{kind} weights of {tuple(packed.shape)} bytes do not hold {in_features} inputs")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.packed = nn.Parameter(packed.contiguous(), requires_grad=False)  # (tiles, tile bytes) uint8
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self._job, self._at = None, None  # the weights' part of the kernel's job, built once
        self._shape = ("q8dot", kind, in_features, out_features)  # what calls alike share their thread count by
        self._keys: dict[int, tuple] = {}  # rows -> the thread-count key of calls of that many rows
        self._macs = in_features * out_features  # multiply-adds a row

    @classmethod
    def from_grid(cls, grid, bias: torch.Tensor | None = None) -> DotLinear:
        """A GGUF's Q4_0 / Q4_1 / Q4_K blocks (``fabric.compute.gguf_grid.FileGrid``), exactly (Q4_K
        in its own factors where the grid keeps them)."""
        kind, packed = pack_int4(grid.codes, grid.scale, grid.minimum, grid.factors)
        out, n = grid.codes.shape
        return cls(kind, packed, n, out, bias)

    @classmethod
    def from_int8(cls, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> DotLinear:
        """int8 rows (out, in) with a scale per row (``quant.Int8Linear``'s), or Q8_0's per block."""
        kind, packed = pack_int8(weight, scales)
        return cls(kind, packed, weight.shape[1], weight.shape[0], bias)

    @staticmethod
    def joinable(parts: list[nn.Module]) -> bool:
        """Can ``parts`` be one module (:meth:`concatenated`)? Not for other kinds or inputs, or
        a part before the last not in whole tiles."""
        return (all(isinstance(p, DotLinear) for p in parts) and len({(p.kind, p.in_features) for p in parts}) == 1
                and not any(p.out_features % TILE for p in parts[:-1]))

    @classmethod
    def concatenated(cls, parts: list[DotLinear]) -> DotLinear | None:
        """One module whose outputs are ``parts``' side by side (each output's bits as its part
        gives them: an output's arithmetic is its own), or None where not :meth:`joinable`."""
        first = parts[0]
        if not cls.joinable(parts):
            return None
        bias = None
        if any(p.bias is not None for p in parts):
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=torch.bfloat16)
                              for p in parts])
        return cls(first.kind, torch.cat([p.packed for p in parts]), first.in_features,
                   sum(p.out_features for p in parts), bias)

    def share(self, parts: list[DotLinear]) -> None:
        """Make ``parts``' weights views of this module's (one copy in memory); ``self`` is their
        :meth:`concatenated`."""
        at = 0
        for p in parts:
            tiles = p.packed.shape[0]
            p.packed = nn.Parameter(self.packed[at:at + tiles], requires_grad=False)
            p._job = None
            at += tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (rows, in)
        if x2.dtype not in _FORMATS:
            x2 = x2.float()
        return self.rows(x2.contiguous()).to(x.dtype).view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) contiguous, bfloat16 or float32 -> (rows, out) in its dtype, bias added:
        the product with nothing around it (the lean layers call it a hundred times a token, so
        what it looks up is looked up once: a Python call costs as much as a small product)."""
        x = x if x.is_contiguous() else x.contiguous()
        n = x.shape[0]
        y = torch.empty(n, self.out_features, dtype=x.dtype)  # (rows, out)
        if n:
            job = self._job_for()
            job.x, job.y, job.rows = x.data_ptr(), y.data_ptr(), n
            job.xfmt = job.yfmt = _FORMATS[x.dtype]
            if splits.run(self.key(n), n * self._macs, torch.get_num_threads(), self._call):
                raise MemoryError("q8dot: no memory for the quantized rows")
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def key(self, rows: int) -> tuple:
        """What calls of ``rows`` rows share their thread count by (``fabric.compute.splits``)."""
        return self._keys.get(rows) or self._keys.setdefault(rows, (self._shape, rows.bit_length()))

    def _job_for(self) -> _DJob:
        """The kernel's job, its weights' part kept from the last call while they stay where
        they were."""
        at = self._parameters["packed"].data_ptr()
        if self._job is None or self._at != at:
            self._at = at
            self._job = _DJob(at, None, None, 0, self.in_features, self.out_features, KINDS[self.kind], 0, 0)
            self._call = functools.partial(self._kernel.meshnet_q8dot, ctypes.byref(self._job))  # (threads) -> rc
        return self._job

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.kind} on q8dot")


class _NormArgs(ctypes.Structure):
    """kernels/q8dot.c's ``NormArgs``: kernels/lean.c's norm by address, its weight and settings."""
    _fields_ = [("fn", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("eps", ctypes.c_float), ("lanes", ctypes.c_int)]


class DotMLP:
    """A llama MLP and the residual after it in one kernel call (kernels/q8dot.c's
    ``meshnet_q8dot_mlp``): ``down(silu(gate) * up) + residual``, rounded to bfloat16 where
    torch's operators round. silu is a table of torch's own bfloat16 silu of every bfloat16, so
    its bits are torch's by construction. With :meth:`after`, o_proj, the residual add and the
    norm before the MLP join the call (:meth:`after_attention`). A lean layer saves up to nine
    operator calls a layer this way (``fabric/compute/lean_layers.py`` checks the bits against
    them before it uses one)."""

    __slots__ = ("gate_up", "down", "table", "_fn", "o", "_norm", "_weight", "_after")

    def __init__(self, gate_up: DotLinear, down: DotLinear):
        if not self.fits(gate_up, down):
            raise ValueError("not a gate/up and down pair the fused kernel takes")
        self.gate_up, self.down, self.table = gate_up, down, silu_table()
        self._fn = gate_up._kernel.meshnet_q8dot_mlp  # its argument types: ``kernel()``
        self.o, self._norm, self._weight, self._after = None, None, None, None

    def after(self, o: DotLinear, norm) -> DotMLP:
        """Take in what comes before the MLP too (:meth:`after_attention`): o_proj ``o`` and the
        residual add after it, and the post-attention norm ``norm`` (``lean_ops.Norm`` on its C
        kernel, one weight row)."""
        if not (isinstance(o, DotLinear) and o.bias is None and o.out_features == self.gate_up.in_features
                and norm.kernel is not None and norm.groups == 1 and norm.n == o.out_features):
            raise ValueError("not an o_proj and norm the fused kernel takes")
        self.o = o
        self._norm = _NormArgs(ctypes.cast(norm.kernel, ctypes.c_void_p), norm.weight.data_ptr(), norm.eps, norm.lanes)
        self._after = self.gate_up._kernel.meshnet_q8dot_after_attention  # its argument types: ``kernel()``
        self._weight = norm.weight  # read by address: kept alive here
        return self

    def after_attention(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """a (rows, heads * head_dim) the attention's output, x (rows, hidden) the layer's input,
        both bfloat16 and contiguous -> the layer's output ``mlp(norm(o(a) + x)) + o(a) + x`` as
        the operators round it; None as :meth:`__call__` answers None."""
        counts = self._threads(a, x, (self.o, self.gate_up, self.down))
        return None if counts is None else self.run_after(a, x, counts)

    def run_after(self, a: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """:meth:`after_attention` on ``counts`` threads for o, gate/up and down."""
        out = torch.empty_like(x)
        o, gate_up, down = self.o._job_for(), self.gate_up._job_for(), self.down._job_for()
        o.x, o.rows, o.xfmt = a.data_ptr(), a.shape[0], _FORMATS[torch.bfloat16]
        down.y, down.rows = out.data_ptr(), a.shape[0]
        if self._after(o, x.data_ptr(), self._norm, gate_up, down, self.table.data_ptr(), (ctypes.c_int * 3)(*counts)):
            raise MemoryError("q8dot: no memory for the layer's rows (or a width the norm's kernel does not take)")
        return out

    @staticmethod
    def fits(gate_up: nn.Module, down: nn.Module) -> bool:
        """Both on the kernel, no bias, gate and up side by side over down's inputs, and those
        in whole vectors (a silu over a row's tail would run torch's scalar code, not its vectors)."""
        return (isinstance(gate_up, DotLinear) and isinstance(down, DotLinear) and gate_up.bias is None
                and down.bias is None and gate_up.out_features == 2 * down.in_features
                and down.out_features == gate_up.in_features and down.in_features % 64 == 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """x (rows, hidden) normed, residual (rows, hidden), both bfloat16 and contiguous -> a new
        (rows, hidden); None while the products' thread counts are still being learnt (the
        caller runs them one by one, which teaches ``fabric.compute.splits``), or for rows that are
        not contiguous."""
        counts = self._threads(x, residual, (self.gate_up, self.down))
        return None if counts is None else self.run(x, residual, *counts)

    @staticmethod
    def _threads(rows: torch.Tensor, other: torch.Tensor, products: tuple[DotLinear, ...]) -> list[int] | None:
        """Each product's learnt thread count for a call over ``rows``; None while one is still
        being learnt, or where ``rows`` or ``other`` is not contiguous."""
        if not (rows.is_contiguous() and other.is_contiguous()):
            return None
        n, threads = rows.shape[0], torch.get_num_threads()
        counts = [splits.settled(m.key(n), n * m._macs, threads) for m in products]
        return None if None in counts else counts

    def run(self, x: torch.Tensor, residual: torch.Tensor, first: int, second: int) -> torch.Tensor:
        """The call on ``first`` threads for gate/up and ``second`` for down."""
        out = torch.empty_like(residual)
        gate_up, down = self.gate_up._job_for(), self.down._job_for()
        gate_up.x, gate_up.rows, gate_up.xfmt = x.data_ptr(), x.shape[0], _FORMATS[torch.bfloat16]
        down.y, down.rows = out.data_ptr(), x.shape[0]
        if self._fn(gate_up, down, self.table.data_ptr(), residual.data_ptr(), first, second):
            raise MemoryError("q8dot: no memory for the MLP's rows")
        return out


@functools.cache
def silu_table() -> torch.Tensor:
    """torch's bfloat16 silu of every bfloat16, indexed by its bits: (65536,) bfloat16."""
    every = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.nn.functional.silu(every).contiguous()


def quantized_rows(x: torch.Tensor, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's quantization of rows x (rows, in) bfloat16 or float32 (for checks), on
    ``lib`` (another build) or this machine's: codes (rows, in) int8, steps (rows, in / 32)
    float32, sums of codes (rows, in / 32) int32."""
    lib = lib or kernel()
    x = x.contiguous() if x.dtype in _FORMATS else x.float().contiguous()
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=torch.int8)
    d = torch.empty(rows, n // BLOCK, dtype=torch.float32)
    s = torch.empty(rows, n // BLOCK, dtype=torch.int32)
    job = _DJob(None, x.data_ptr(), None, rows, n, 0, 0, _FORMATS[x.dtype], 0)
    if lib.meshnet_q8dot_quantize(ctypes.byref(job), ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(d.data_ptr()),
                                  ctypes.c_void_p(s.data_ptr())):
        raise ValueError("q8dot: rows not in whole blocks of 32")
    return q, d, s
