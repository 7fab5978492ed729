"""The default mode's decoder layers as plain functions over pre-fetched tensors. No sockets.

transformers' decoder layers cost a small model more in Python than in arithmetic: a
SmolLM2-135M token runs ~4,600 torch operators, ~150 per layer (module calls, kwargs, views,
casts, rotary in pieces), where the matrix products take about half the time
(docs/BENCHMARKS.md, "Where a default-mode token goes"). A ``LeanLayer`` runs the same layer
of the llama, mistral, qwen2 and qwen3 families with the same operators on the same
operands, so every output is the same bits, in about a quarter as many:

- q, k and v are one matmul, gate and up one: their weights (int4 packed, int8, with their
  scales) are concatenated along the output once, here, and the modules' own weights become
  views of the fused ones (no second copy). Each output column of a weight-only kernel has
  the same bits whether its weight is alone or fused: checked on every fusion at build time
  (``_fused``), where a mismatch keeps the projections apart;
- RoPE rotates q and k together, as ``x * cos + swap(x) * sin`` with the sign of
  ``rotate_half`` moved into a per-pass sine table (multiplying by -s rounds as by s);
- RMSNorm is one call and RoPE another (fabric/compute/lean_ops.py: a C kernel that rounds
  where torch's operators round, checked against them before it is used), else ATen's
  ``rms_norm`` without a weight (the same upcast, mean of squares, rsqrt and cast back as
  transformers' eight calls, in one), then the weight's product;
- the attention kernel (fabric/compute/attention.py) is called directly, each mask turned
  into the kernel's once a pass (a mixed pass's too: each part's); it reads q and k in place
  through their strides;
- residual adds write into the fresh output of o_proj and down_proj (a + b is b + a);
- on the q8dot kernel everything after the attention is one C call (``q8dot.DotMLP``): o_proj
  and the residual add, the norm (lean.c's, by address), gate/up, silu from a table of torch's
  own bfloat16 silu, the product with up, down, the add; used where it gives the operators'
  bits on random rows, else the MLP alone in one call, else the operators.

The cache is the pass's own (a session's,
the batch group's rows, a mixed pass's parts): ``update`` as the modules call it. Other
families, float32 (exact mode) and CUDA keep transformers' modules.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import attention as invariant
from . import mixed, native
from .decode_pass import DecodePass
from .lean_ops import Norm, Rotary
from .q8dot import DotLinear, DotMLP
from .quant import Int4Linear, Int8Linear

log = logging.getLogger(__name__)

FAMILIES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
PROBE_ROWS = 5  # rows of the random input that checks a fusion's bits at build time

Proj = Callable[[torch.Tensor], torch.Tensor]  # (rows, in) bfloat16 -> (rows, out)


def _kernel(linear: nn.Module) -> Proj:
    """``linear``'s product over bfloat16 rows, bias included, with the module's own arithmetic."""
    if isinstance(linear, Int4Linear):
        w, g, sz = linear.weight, linear.group_size, linear.scales_zeros
        mm = lambda x: torch._weight_int4pack_mm_for_cpu(x, w, g, sz)  # noqa: E731
    elif isinstance(linear, Int8Linear):
        w, s = linear.weight, linear.scales
        mm = lambda x: torch._weight_int8pack_mm(x, w, s)  # noqa: E731
    elif isinstance(linear, nn.Linear):  # a float linear: addmm with its bias, as nn.Linear
        w, b = linear.weight, linear.bias
        return lambda x: F.linear(x, w, b)  # noqa: E731
    elif isinstance(linear, DotLinear):  # the q8dot kernel (MESHNET_Q8DOT), bias included
        return linear.rows
    else:  # a kernel of its own (qblock.BlockLinear: the file's Q5 blocks): the module itself
        return linear
    if linear.bias is None:
        return mm
    bias = linear.bias
    return lambda x: mm(x) + bias  # noqa: E731


def _fusable(linears: list[nn.Module]) -> bool:
    kinds = {type(m) for m in linears}
    if kinds == {DotLinear}:
        return DotLinear.joinable(linears)
    if kinds == {Int4Linear}:
        return len({m.group_size for m in linears}) == 1 and len({m.in_features for m in linears}) == 1
    return kinds == {Int8Linear} and len({m.in_features for m in linears}) == 1


def _fuse_weights(linears: list[nn.Module]) -> nn.Module:
    """One module whose outputs are ``linears``' outputs side by side; each part's weight
    becomes a view of the fused one (int8 and packed int4 rows are whole output rows)."""
    first = linears[0]
    if isinstance(first, DotLinear):
        return DotLinear.concatenated(linears)
    weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=torch.bfloat16)
                          for m in linears])
    out = sum(m.out_features for m in linears)
    if isinstance(first, Int4Linear):
        sz = torch.cat([m.scales_zeros for m in linears], dim=1).contiguous()
        fused = Int4Linear(weight, sz, first.in_features, out, first.group_size, bias)
    else:
        fused = Int8Linear(weight, torch.cat([m.scales for m in linears]), bias)
    return fused


def _fused(linears: list[nn.Module]) -> Proj:
    """One product for ``linears`` (outputs side by side), fused where the fused kernel gives
    each column the bits the part gives alone; else the parts' products, concatenated."""
    parts = [_kernel(m) for m in linears]
    if _fusable(linears):
        fused = _fuse_weights(linears)
        probe = torch.randn(PROBE_ROWS, linears[0].in_features, generator=torch.Generator().manual_seed(0))
        probe = probe.to(torch.bfloat16)
        if torch.equal(_kernel(fused)(probe), torch.cat([p(probe) for p in parts], dim=1)):
            _share(fused, linears)
            return _kernel(fused)
        log.info("a fused projection changed bits on this CPU: q/k/v and gate/up stay apart")
    return lambda x: torch.cat([p(x) for p in parts], dim=1)  # noqa: E731


def _share(fused: nn.Module, linears: list[nn.Module]) -> None:
    """The modules now read the fused weight: one copy in memory."""
    if isinstance(fused, DotLinear):
        fused.share(linears)
        return
    at = 0
    for m in linears:
        m.weight = nn.Parameter(fused.weight[at:at + m.out_features], requires_grad=False)
        at += m.out_features


class LeanLayer:
    """One decoder layer of the llama family (llama, mistral, qwen2, qwen3), its tensors fetched once."""

    __slots__ = ("qkv", "o", "gate_up", "down", "act", "norm1", "norm2", "qk_norm", "heads",
                 "kv_heads", "head_dim", "scaling", "intermediate", "layer_idx", "mlp")

    def __init__(self, layer: nn.Module, index: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = index
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.intermediate = mlp.gate_proj.out_features
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj])
        self.o, self.down = _kernel(attn.o_proj), _kernel(mlp.down_proj)
        self.act = F.silu if type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU") else mlp.act_fn
        eps = layer.input_layernorm.variance_epsilon
        self.norm1, self.norm2 = Norm(layer.input_layernorm.weight, eps), Norm(layer.post_attention_layernorm.weight, eps)
        self.qk_norm = None  # qwen3: RMSNorm over each q and k head, one weight row per head
        if hasattr(attn, "q_norm"):
            self.qk_norm = Norm(torch.cat([attn.q_norm.weight[None].expand(self.heads, -1),
                                           attn.k_norm.weight[None].expand(self.kv_heads, -1)]),
                                attn.q_norm.variance_epsilon)
        self.mlp = None  # the operators, until _one_call has checked a call against them
        self.mlp = self._one_call(mlp.down_proj)

    def __call__(self, x: torch.Tensor, b: int, s: int, rope: Rotary, mask, cache, attend) -> torch.Tensor:
        """x (b * s, hidden) bfloat16 -> the layer's output (b * s, hidden), a new tensor."""
        a = self._attention(self.norm1(x), b, s, rope, mask, cache, attend)
        out = self.mlp.after_attention(a, x) if self.mlp is not None and self.mlp.o is not None else None
        return out if out is not None else self._after_attention(a, x)

    def _after_attention(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o_proj over the attention's output a, the residual x, the norm and the MLP: each on its own."""
        h = self.o(a).add_(x)
        normed = self.norm2(h)
        out = self.mlp(normed, h) if self.mlp is not None else None
        return out if out is not None else self._mlp(normed, h)

    def _mlp(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The MLP over the normed rows x (rows, hidden), plus the residual h, operator by operator."""
        gate_up = self.gate_up(x)  # (rows, 2 intermediate)
        act = self.act(gate_up[:, :self.intermediate]).mul_(gate_up[:, self.intermediate:])
        return self.down(act).add_(h)  # residual + mlp

    def _one_call(self, down: nn.Module) -> DotMLP | None:
        """The MLP as one kernel call (``DotMLP``) where its projections are on the q8dot kernel
        and it gives ``_mlp``'s bits on random rows, with o_proj, the residual and the norm before
        it in the call too where that gives ``_after_attention``'s bits; else None."""
        gate_up = getattr(self.gate_up, "__self__", None)  # the fused gate/up module, when fused
        if self.act is not F.silu or not DotMLP.fits(gate_up, down):
            return None
        fused, hidden = DotMLP(gate_up, down), down.out_features
        if not _agrees(lambda x, h: fused.run(x, h, 1, 1), self._mlp, (hidden, hidden)):
            log.info("the MLP in one kernel call changed bits on this CPU: its operators keep it")
            return None
        o = getattr(self.o, "__self__", None)
        if not (isinstance(o, DotLinear) and o.bias is None and self.norm2.kernel is not None):
            return fused
        try:
            fused.after(o, self.norm2)
        except ValueError:  # shapes the call does not take
            return fused
        if not _agrees(lambda a, x: fused.run_after(a, x, [1, 1, 1]), self._after_attention, (o.in_features, hidden)):
            log.info("o_proj, the norm and the MLP in one kernel call changed bits on this CPU: the MLP's call "
                     "alone keeps them")
            fused.o = None
        return fused

    def _attention(self, x: torch.Tensor, b: int, s: int, rope, mask, cache, attend) -> torch.Tensor:
        """Attention over the normed rows x (b * s, hidden): its output (b * s, heads * head_dim), before o_proj."""
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(x)  # (b * s, (heads + 2 kv) d)
        qk = qkv[:, :(heads + kv) * d].view(b, s, heads + kv, d)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = rope(qk)  # q * cos + rotate_half(q) * sin, for q and k at once
        # q (b, heads, s, d), k and v (b, kv, s, d): the views qk[:, :, :heads].transpose(1, 2),
        # qk[:, :, heads:].transpose(1, 2) and qkv[:, (heads + kv) * d:].view(b, s, kv, d).transpose(1, 2),
        # one operator each instead of two or three
        st, at, row = qk.stride(), qk.storage_offset(), qkv.stride(0)
        q = qk.as_strided((b, heads, s, d), (st[0], st[2], st[1], st[3]), at)
        k = qk.as_strided((b, kv, s, d), (st[0], st[2], st[1], st[3]), at + heads * st[2])
        v = qkv.as_strided((b, kv, s, d), (s * row, d, row, 1), qkv.storage_offset() + (heads + kv) * d)
        k, v = cache.update(k, v, self.layer_idx)
        out = attend(None, q, k, v, mask, scaling=self.scaling)[0]  # (b, s, heads, d)
        return out.view(b * s, heads * d)


def _agrees(fast: Callable, slow: Callable, widths: tuple[int, ...]) -> bool:
    """Whether ``fast`` gives ``slow``'s bits on random bfloat16 rows (one, and PROBE_ROWS) of ``widths``."""
    gen = torch.Generator().manual_seed(1)
    for rows in (1, PROBE_ROWS):
        args = [torch.randn(rows, width, generator=gen).bfloat16() for width in widths]
        if not torch.equal(fast(*args), slow(*args)):
            return False
    return True


class _KernelPass:
    """The C attention kernel for one pass: each mask is turned into the kernel's once, not per layer."""

    def __init__(self, kernel):
        self.kernel, self.keeps = kernel, {}

    def __call__(self, module, query, key, value, mask, scaling=None) -> tuple[torch.Tensor, None]:
        keep = self.keep(mask, query.shape[2], key.shape[2])
        return invariant.by_kernel(self.kernel, query, key, value, keep, scaling, None), None

    def keep(self, mask, q: int, k: int) -> torch.Tensor | None:
        """The kernel's mask for ``mask`` over q queries and k keys (``kernel_keep``), made once a pass."""
        if mask is None:
            return None
        if (id(mask), k) not in self.keeps:  # the masks live as long as the pass
            self.keeps[id(mask), k] = invariant.kernel_keep(mask, q, k)
        return self.keeps[id(mask), k]


class LeanStack:
    """A shard's decoder layers as ``LeanLayer``s, run over a pass as the modules would be."""

    def __init__(self, config, layers: dict[int, LeanLayer]):
        self.config, self.layers = config, layers
        self.passes: dict[tuple[int, int], DecodePass | None] = {}  # (start, end) -> one call a decode pass

    def attend(self):
        """The attention function of the pass now running: the invariant kernel (its mask
        converted once a pass), or a mixed pass's split over rows and chunks around it; None
        for anything else (the modules run)."""
        impl = self.config._attn_implementation
        kernel = native.library("attention") if impl in (invariant.NAME, mixed.NAME) else None
        if impl == invariant.NAME:
            return _KernelPass(kernel) if kernel is not None else invariant.attention
        if impl == mixed.NAME and mixed.INNER.get() is invariant.attention:
            return functools.partial(mixed.attention, inner=_KernelPass(kernel)) if kernel is not None else mixed.attention
        return None

    def run(self, hidden: torch.Tensor, tables: dict, masks, cache, kinds: list[str], start: int, end: int,
            attend) -> torch.Tensor:
        """Layers start..end over ``hidden`` (b, s, hidden); ``tables`` {kind: (cos, sin)},
        ``masks`` one per kind or one for all, ``kinds`` every layer's kind."""
        b, s, n = hidden.shape
        ropes = {kind: Rotary(*table) for kind, table in tables.items()}
        x = hidden.reshape(b * s, n)  # (b * s, hidden)
        if s == 1 and len(ropes) == 1 and isinstance(attend, _KernelPass):
            out = self._in_one_call(x, ropes, masks, cache, attend, start, end)
            if out is not None:
                return out.view(b, s, n)
        for i in range(start, end + 1):
            kind = kinds[i]
            x = self.layers[i](x, b, s, ropes[kind], masks[kind] if isinstance(masks, dict) else masks, cache,
                               attend)
        return x.view(b, s, n)

    def decode_pass(self, start: int, end: int) -> DecodePass | None:
        """Layers start..end's pass in one kernel call (made once), or None where none is taken."""
        if (start, end) not in self.passes:
            self.passes[start, end] = DecodePass.of(self.layers, start, end)
        return self.passes[start, end]

    def _in_one_call(self, x: torch.Tensor, ropes: dict, masks, cache, attend, start: int,
                     end: int) -> torch.Tensor | None:
        """A decode pass (x (b, hidden), one kind of layer) in one kernel call where
        ``fabric.compute.decode_pass`` takes it; else None."""
        fast = self.decode_pass(start, end)
        if fast is None:
            return None
        (kind, rope), = ropes.items()
        return fast.run(x, rope, masks[kind] if isinstance(masks, dict) else masks, cache, attend)


def build(weights) -> LeanStack | None:
    """A ``LeanStack`` of ``weights``' decoder layers, or None where they keep transformers'
    modules: another family, float32 or float16, not a CPU, not the invariant attention."""
    config, layers = weights.config, weights.layers
    if (weights.device.type != "cpu" or weights.dtype != torch.bfloat16
            or config._attn_implementation != invariant.NAME or not layers
            or any(type(layer).__name__ not in FAMILIES for layer in layers.values())):
        return None
    with torch.no_grad():  # not inference mode: the modules' weights become views of these
        stack = LeanStack(config, {i: LeanLayer(layer, i) for i, layer in layers.items()})
    stack.decode_pass(min(layers), max(layers))  # the shard's own pass: its kernel built now, not at the first step
    return stack
