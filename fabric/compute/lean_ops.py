"""A lean layer's RMSNorm and rotary embedding: one C call each where it gives torch's bits.

transformers' RMSNorm is about ten torch operators (upcast, square, mean, add, rsqrt, multiply,
cast, the weight's product) and the rotary embedding five; on a slow core each costs 4-6 us
before it computes anything, so on the Zen 1 machine of docs/BENCHMARKS.md the 60 norms of a
SmolLM2 token took 3.7 ms of a 31 ms pass. ``fabric/compute/kernels/lean.c`` does each in one
call with the same arithmetic, rounding where torch rounds.

The one order that could differ is the norm's sum of squares: the C kernel adds them as ATen's
cascade sum does, in vectors of ATen's width on this CPU (8 floats, or 16 with AVX-512). Which
width that is, and whether the kernel matches at all, is checked on random rows against torch's
own operators before the kernel is used for a row width (``_lanes``); where neither width
matches (another ATen, another compiler), the norm keeps torch's operators. The rotary
embedding has no order to differ in; it is checked once all the same. So a lean layer gives the
modules' bits either way (``tests/test_lean_layers.py``), and only its speed depends on the
kernel.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from . import native

log = logging.getLogger(__name__)

PROBE_ROWS = 64  # random rows each width's check compares
WIDEST = 16384  # the kernel's widest row (kernels/lean.c)
Tables = tuple[torch.Tensor, torch.Tensor]  # cos, sin (b, s, 1, d): ``rope_tables``'


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dim, in two calls: ``rms_norm`` without a weight is
    the same float32 upcast, mean of squares, rsqrt and cast back, in ATen (the same bits:
    ``tests/test_lean_layers.py``), then the weight's product in x's dtype."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def torch_rope(qk: torch.Tensor, rope: Tables) -> torch.Tensor:
    """q * cos + rotate_half(q) * sin for q and k at once: qk (b, s, heads, d) -> a new tensor."""
    cos, sin = rope
    d = qk.shape[-1]
    swapped = qk.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)  # [x2, x1]
    out = qk * cos
    out += swapped * sin
    return out


class Norm:
    """``weight * rms_norm(x)`` over x's last dim, weight (n,) or one row per head (heads, n):
    by the C kernel where it gives torch's bits on rows of this width, else by torch."""

    __slots__ = ("weight", "eps", "groups", "n", "lanes", "kernel")

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight.contiguous(), float(eps)
        self.n = weight.shape[-1]
        self.groups = weight.shape[0] if weight.dim() == 2 else 1
        self.lanes = _lanes(self.n) if weight.dtype == torch.bfloat16 else None
        self.kernel = _library().meshnet_rms_norm if self.lanes else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, n), or (b, s, heads, n) for a weight per head: a new contiguous tensor."""
        if self.kernel is None or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or not _even_rows(x, self.groups):
            return torch_norm(x, self.weight, self.eps)
        out = torch.empty_like(x) if self.groups == 1 else torch.empty(*x.shape, dtype=torch.bfloat16)
        rows = x.numel() // self.n
        run = _position_stride(x) if self.groups > 1 else x.stride(-2)
        if self.kernel(x.data_ptr(), rows, self.n, self.groups, x.stride(-2), run, self.weight.data_ptr(), self.eps,
                       self.lanes, out.data_ptr()):
            raise ValueError(f"the lean norm kernel does not take rows of {self.n} in runs of {self.groups}")
        return out


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> Tables:
    """The rotary tables (b, s, d) as a lean layer applies them to (b, s, heads, d): cos, and
    sin with rotate_half's sign in its first half."""
    half = sin.shape[-1] // 2
    return cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None]


class Rotary:
    """One pass's rotary tables for one kind of layer (cos, sin (b, s, d), as the model's rotary
    embedding gives them), applied to q and k at once: ``torch_rope``'s bits, by the C kernel
    where it can read them in place."""

    __slots__ = ("tables", "kernel", "cos_at", "sin_at", "strides", "shape")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.tables = rope_tables(cos, sin)
        cos, sin = self.tables
        self.kernel = None
        if (cos.dtype == sin.dtype == torch.bfloat16 and cos.stride() == sin.stride() and cos.stride(-1) == 1
                and _rope_checked()):
            self.kernel = _library().meshnet_rope
            self.cos_at, self.sin_at = cos.data_ptr(), sin.data_ptr()
            self.strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1))
            self.shape = cos.shape[:2]  # (b or 1, s)

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        """qk (b, s, heads, d): a new contiguous tensor."""
        b, s, heads, d = qk.shape
        st = qk.stride()
        if (self.kernel is None or qk.dtype != torch.bfloat16 or st[3] != 1 or st[2] != d or not _even_rows(qk, heads)
                or self.shape[1] != s or self.shape[0] not in (1, b)):  # the kernel broadcasts a batch of 1 only
            return torch_rope(qk, self.tables)
        out = torch.empty(b, s, heads, d, dtype=torch.bfloat16)
        self.kernel(qk.data_ptr(), b, s, heads, d, _position_stride(qk), self.cos_at, self.sin_at, *self.strides,
                    out.data_ptr())
        return out


def _even_rows(x: torch.Tensor, groups: int) -> bool:
    """Whether the kernel can walk x's rows: (rows, n), or (b, s, groups, n) whose positions are
    evenly spaced (b's stride is s of s's, or s is 1: a decode batch, whose view of the q/k/v
    product gives its length-1 dim any stride)."""
    if groups == 1:
        return x.dim() == 2
    return x.dim() == 4 and x.shape[2] == groups and (x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1))


def _position_stride(x: torch.Tensor) -> int:
    """The elements between consecutive positions of x (b, s, ...) walked as b * s rows."""
    return x.stride(0) if x.shape[1] == 1 else x.stride(1)


@functools.cache
def _lanes(n: int) -> int | None:
    """The vector width (8 or 16) at which the kernel adds the squares of rows of n as ATen
    does, float for float, and its norm gives torch's bits, on random rows; None where neither
    width does, or there is no kernel."""
    lib = _library()
    if lib is None or n > WIDEST:
        return None
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(PROBE_ROWS, n, generator=gen) * torch.logspace(-3, 3, PROBE_ROWS)[:, None]).bfloat16()
    weight = torch.randn(n, generator=gen).bfloat16()
    sums, want = x.float().pow(2).sum(-1), torch_norm(x, weight, 1e-6)
    for lanes in (8, 16):
        if n >= lanes and torch.equal(square_sums(x, lanes), sums):
            out = torch.empty_like(x)
            lib.meshnet_rms_norm(x.data_ptr(), PROBE_ROWS, n, 1, n, n, weight.data_ptr(), 1e-6, lanes, out.data_ptr())
            if torch.equal(out, want):
                return lanes
    log.info("the lean norm kernel does not give torch's bits on rows of %d here: torch's operators keep it", n)
    return None


def square_sums(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """The kernel's sums of the squares of x's rows (rows, n) bfloat16, its vectors ``lanes`` wide."""
    x = x.contiguous()
    sums = torch.empty(x.shape[0], dtype=torch.float32)
    if _library().meshnet_square_sums(x.data_ptr(), x.shape[0], x.shape[1], lanes, sums.data_ptr()):
        raise ValueError(f"rows of {x.shape[1]} in vectors of {lanes}: not a shape the kernel takes")
    return sums


@functools.cache
def _rope_checked() -> bool:
    """Whether the kernel's rotary embedding gives ``torch_rope``'s bits on random tables."""
    if _library() is None:
        return False
    gen = torch.Generator().manual_seed(0)
    qk = torch.randn(2, 3, 5, 64, generator=gen).bfloat16()
    cos, sin = (torch.randn(2, 3, 64, generator=gen).bfloat16() for _ in range(2))
    tables = rope_tables(cos, sin)
    (c, s), out = tables, torch.empty_like(qk)
    _library().meshnet_rope(qk.data_ptr(), 2, 3, 5, 64, qk.stride(1), c.data_ptr(), s.data_ptr(), c.stride(0),
                            c.stride(1), out.data_ptr())
    ok = torch.equal(out, torch_rope(qk, tables))
    if not ok:
        log.info("the lean rotary kernel does not give torch's bits here: torch's operators keep it")
    return ok


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _library() -> ctypes.CDLL | None:
    """kernels/lean.c, its functions' argument types set (plain ints in, no ctypes objects per call)."""
    lib = native.library("lean")
    if lib is not None:
        lib.meshnet_rms_norm.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, ctypes.c_float, ctypes.c_int, _PTR]
        lib.meshnet_rms_norm.restype = ctypes.c_int
        lib.meshnet_rope.argtypes = [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR]
        lib.meshnet_rope.restype = None
        lib.meshnet_square_sums.argtypes = [_PTR, _I64, _I64, ctypes.c_int, _PTR]
        lib.meshnet_square_sums.restype = ctypes.c_int
        lib.meshnet_put_lines.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]
        lib.meshnet_put_lines.restype = None
        lib.meshnet_sketch.argtypes = [_PTR, ctypes.c_int, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR]
        lib.meshnet_sketch.restype = None
    return lib


def count_sketch(rows: torch.Tensor, bucket: torch.Tensor, sign: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``out[r, bucket[i]] += rows[r, i] * sign[i]`` in float32 for rows (n, width) of bfloat16 or
    float32 on the CPU, in one C call, with the bits of torch's ``index_add_`` (the same additions
    in the same order); None where the kernel does not take them (nothing computed)."""
    lib = _library()
    if (lib is None or rows.device.type != "cpu" or rows.dtype not in (torch.bfloat16, torch.float32)
            or rows.stride(-1) != 1 or bucket.dtype != torch.int64 or sign.dtype != torch.float32):
        return None
    out = torch.empty(rows.shape[0], dim, dtype=torch.float32)
    lib.meshnet_sketch(rows.data_ptr(), rows.dtype == torch.bfloat16, rows.shape[0], rows.shape[1],
                       rows.stride(0), bucket.data_ptr(), sign.data_ptr(), dim, out.data_ptr())
    return out


def put_lines(keys: torch.Tensor, values: torch.Tensor, lines: torch.Tensor, key_states: torch.Tensor,
              value_states: torch.Tensor) -> bool:
    """Write key_states and value_states (rows, heads, 1, d) into the lines ``lines`` (int64, one per
    row and head) of keys and values seen as (lines, d), in one C call: a copy, torch's two
    ``index_copy_`` calls' bits at a quarter of their time. False (nothing written) where the
    kernel does not take them: not 16-bit, or a line's d values not contiguous."""
    lib = _library()
    rows, heads, q, d = key_states.shape
    if (lib is None or keys.element_size() != 2 or key_states.dtype != keys.dtype
            or value_states.dtype != keys.dtype or key_states.stride(-1) != 1 or value_states.stride(-1) != 1
            or q != 1 or d != keys.shape[-1] or value_states.shape != key_states.shape or rows * heads != lines.numel()
            or not (keys.is_contiguous() and values.is_contiguous() and lines.is_contiguous())):
        return False
    lib.meshnet_put_lines(key_states.data_ptr(), key_states.stride(0), key_states.stride(1), value_states.data_ptr(),
                          value_states.stride(0), value_states.stride(1), rows, heads, d, lines.data_ptr(),
                          keys.data_ptr(), values.data_ptr())
    return True
