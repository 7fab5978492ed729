"""A decode pass over a shard's lean layers in one C call (``fabric/compute/kernels/decode.c``).

A lean layer's one-token step makes about twenty Python-level calls, and on the 2-core machines
of docs/BENCHMARKS.md they cost as much as the layer's products at SmolLM2's size (*One call a
decode pass*). The kernel makes the same kernel calls, in the same order, on the same bytes, so
a pass through it gives the layer-by-layer bits (``tests/test_decode_pass.py``). It takes a pass
the layers' own kernels would all run: one new position per row, every layer a lean layer (llama,
mistral, qwen2 with its q/k/v bias, qwen3 with its per-head q and k norm) whose norms, products,
rotary embedding and attention are on their C kernels and whose o_proj, norm and MLP are one call
(``DotMLP.after_attention``), and a bfloat16 cache that keeps its keys where the attention reads
them in place: a session's own (``GrowingLayer``) or the batch group's rows (``RowsStep``).
Anything else answers None, and the caller runs the layers one by one.
"""
from __future__ import annotations

import ctypes
import os

import torch

from . import native, splits
from .cache import GrowingLayer
from .lean_ops import Rotary
from .q8dot import DotLinear, DotMLP, _DJob, _NormArgs
from .rows import RowsStep

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _Layer(ctypes.Structure):
    """kernels/decode.c's ``Layer``."""
    _fields_ = [("norm1", _NormArgs), ("norm2", _NormArgs), ("qk_norm", _NormArgs), ("bias", _PTR),
                ("qkv", ctypes.POINTER(_DJob)),
                ("o", ctypes.POINTER(_DJob)), ("gate_up", ctypes.POINTER(_DJob)), ("down", ctypes.POINTER(_DJob)),
                ("keys", _PTR), ("values", _PTR), ("scale", ctypes.c_float)]


class _Pass(ctypes.Structure):
    """kernels/decode.c's ``Pass``."""
    _fields_ = [("norm", _PTR), ("rope", _PTR), ("dot", _PTR), ("after", _PTR), ("attend", _PTR),
                ("add_bias", _PTR), ("silu", _PTR),
                ("cos", _PTR), ("sin", _PTR), ("cs_b", _I64), ("cs_s", _I64), ("lines", _PTR), ("first", _I64),
                ("sk", _I64 * 3), ("keep", _PTR), ("skeep", _I64 * 2), ("b", _I64), ("hidden", _I64),
                ("heads", _I64), ("kv_heads", _I64), ("d", _I64), ("width", _I64), ("threads", ctypes.c_int * 5),
                ("x", _PTR), ("out", _PTR)]


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), _PTR).value


def _norm_args(norm) -> _NormArgs:
    """kernels/q8dot.c's NormArgs of ``norm`` (a ``lean_ops.Norm`` on its kernel)."""
    return _NormArgs(ctypes.cast(norm.kernel, _PTR), norm.weight.data_ptr(), norm.eps, norm.lanes)


def takes(layer) -> bool:
    """Whether the kernel can run ``layer`` (a ``LeanLayer``): its products on the q8dot kernel
    (q/k/v's with a bias or none), its norms on their kernel (a per-head q and k norm too, or
    none), and what follows attention in one call."""
    qkv, mlp, qk_norm = getattr(layer.qkv, "__self__", None), layer.mlp, layer.qk_norm
    qk_heads = layer.heads + layer.kv_heads
    return (isinstance(qkv, DotLinear) and isinstance(mlp, DotMLP) and mlp.o is not None
            and layer.norm1.kernel is not None and layer.norm1.groups == 1
            and qkv.out_features == (qk_heads + layer.kv_heads) * layer.head_dim
            and (qkv.bias is None or qkv.bias.shape == (qkv.out_features,))
            and (qk_norm is None or qk_norm.kernel is not None and qk_norm.groups == qk_heads))


class DecodePass:
    """The kernel's view of layers ``first..last`` of a ``LeanStack`` (every one ``takes``)."""

    def __init__(self, layers: dict, first: int, last: int):
        needed = [native.library(name) for name in ("decode", "lean", "q8dot", "attention")]
        self.lib = needed[0] if None not in needed else None  # the others: the kernels it calls
        self.first, self.last = first, last
        self.layers = [layers[i] for i in range(first, last + 1)]
        one = self.layers[0]
        self.shape = (one.heads, one.kv_heads, one.head_dim)
        self.products = (one.qkv.__self__, one.mlp.o, one.mlp.gate_up, one.mlp.down)
        self.structs = None  # the kernel's layers, built at the first pass (the jobs' weights are placed by then)
        self.biases: list[torch.Tensor] = []  # q/k/v's biases in bfloat16, as DotLinear adds them: read by address
        self.args = _Pass()
        if self.lib is not None:
            self._functions(*needed[1:])

    @classmethod
    def of(cls, layers: dict, first: int, last: int) -> DecodePass | None:
        """The kernel's view of layers first..last, or None where one of them is not a layer it
        takes, or they differ in shape, or the kernel cannot be built, or ``MESHNET_DECODE_PASS=0``
        turned it off (the layers then run one by one, as a bench's baseline)."""
        chosen = [layers.get(i) for i in range(first, last + 1)]
        if (os.environ.get("MESHNET_DECODE_PASS", "1").strip() == "0" or not chosen
                or any(layer is None or not takes(layer) for layer in chosen)):
            return None
        shapes = {(layer.heads, layer.kv_heads, layer.head_dim, layer.qkv.__self__.in_features,
                   layer.intermediate) for layer in chosen}
        made = cls(layers, first, last) if len(shapes) == 1 else None
        return made if made is not None and made.lib is not None else None

    def _functions(self, lean: ctypes.CDLL, q8: ctypes.CDLL, attention: ctypes.CDLL) -> None:
        a = self.args
        a.norm, a.rope = _address(lean, "meshnet_rms_norm"), _address(lean, "meshnet_rope")
        a.dot, a.after = _address(q8, "meshnet_q8dot"), _address(q8, "meshnet_q8dot_after_attention")
        a.attend, a.add_bias = _address(attention, "meshnet_attention"), _address(q8, "meshnet_q8dot_add_bias")
        a.silu = self.layers[0].mlp.table.data_ptr()
        a.heads, a.kv_heads, a.d = self.shape
        a.hidden = self.products[0].in_features
        self.lib.meshnet_decode_layers.argtypes = [ctypes.POINTER(_Pass), ctypes.POINTER(_Layer), ctypes.c_int]
        self.lib.meshnet_decode_layers.restype = ctypes.c_int

    def _built(self) -> ctypes.Array:
        made = (_Layer * len(self.layers))()
        for s, layer in zip(made, self.layers):
            mlp, bias = layer.mlp, layer.qkv.__self__.bias
            s.norm1, s.norm2 = _norm_args(layer.norm1), mlp._norm
            if layer.qk_norm is not None:
                s.qk_norm = _norm_args(layer.qk_norm)
            if bias is not None:
                self.biases.append(bias.to(torch.bfloat16).contiguous())
                s.bias = self.biases[-1].data_ptr()
            s.qkv, s.o = ctypes.pointer(layer.qkv.__self__._job_for()), ctypes.pointer(mlp.o._job_for())
            s.gate_up, s.down = ctypes.pointer(mlp.gate_up._job_for()), ctypes.pointer(mlp.down._job_for())
            s.scale = layer.scaling
        return made

    def run(self, x: torch.Tensor, rope: Rotary, mask, cache, attend) -> torch.Tensor | None:
        """x (b, hidden) bfloat16 contiguous, one new position per row -> the layers' output (b,
        hidden); None (nothing run, nothing written) where this pass is not one the kernel takes."""
        b = x.shape[0]
        where = self._cache(cache, b) if x.dtype == torch.bfloat16 and x.is_contiguous() else None
        if where is None:
            return None
        keys, values, lines, first, width, extend = where
        threads = self._threads(b, width, rope)
        if threads is None:
            return None
        keep = attend.keep(mask, 1, width)
        a = self.args
        a.b, a.width, a.first, a.lines, a.sk = b, width, first, lines.data_ptr(), keys[0].stride()[:3]
        a.keep = keep.data_ptr() if keep is not None else None
        a.skeep = (keep.stride(0) if keep is not None and keep.shape[0] > 1 else 0,
                   keep.stride(1) if keep is not None else 0)
        a.cos, a.sin, (a.cs_b, a.cs_s) = rope.cos_at, rope.sin_at, rope.strides
        a.threads = (ctypes.c_int * 5)(*threads)
        self.structs = self.structs if self.structs is not None else self._built()
        for s, k, v in zip(self.structs, keys, values):
            s.keys, s.values = k.data_ptr(), v.data_ptr()
        out = torch.empty_like(x)
        a.x, a.out = x.data_ptr(), out.data_ptr()
        if self.lib.meshnet_decode_layers(a, self.structs, len(self.layers)):
            raise MemoryError("decode pass: no memory for its rows (or a width the norm's kernel does not take)")
        extend()
        return out

    def _threads(self, b: int, width: int, rope: Rotary) -> list[int] | None:
        """Each call's thread count, as the layer-by-layer calls would choose it; None while one is
        still being learnt (the layers then run one by one, which teaches ``fabric.compute.splits``),
        or where the rotary tables are not the kernel's."""
        if rope.kernel is None or rope.shape[1] != 1 or rope.shape[0] not in (1, b):
            return None
        every = torch.get_num_threads()
        if every == 1:
            return [1] * 5
        heads, _, d = self.shape
        attention = ("attention", b.bit_length(), heads, 1, width.bit_length(), d)  # as ``by_kernel`` keys it
        counts = [splits.settled(self.products[0].key(b), b * self.products[0]._macs, every),
                  splits.settled(attention, b * heads * width * d, every),
                  *(splits.settled(m.key(b), b * m._macs, every) for m in self.products[1:])]
        return None if None in counts else counts

    def _cache(self, cache, b: int):
        """Where the layers' new keys go and what attention reads: (keys, values, lines, first,
        width, extend), extend() saying the positions were written; None where the cache is not
        one the kernel writes."""
        if isinstance(cache, RowsStep):
            group = cache.group
            keys = [group.keys[i] for i in range(self.first, self.last + 1)]
            values = [group.values[i] for i in range(self.first, self.last + 1)]
            if (not all(k.is_contiguous() and k.dtype == torch.bfloat16 for k in keys + values)
                    or cache.lines.dtype != torch.int64):
                return None
            return keys, values, cache.lines, cache.lo * keys[0].stride(0), cache.width, lambda: None
        layers = getattr(cache, "layers", None)
        if b != 1 or layers is None or len(layers) <= self.last:
            return None
        chosen = layers[self.first:self.last + 1]
        if not all(type(layer) is GrowingLayer and layer.is_initialized and layer._keys is not None
                   and layer._keys.dtype == torch.bfloat16 for layer in chosen):
            return None
        return GrowingLayer.appending(chosen)
