"""Weight-only quantization of a shard's linear layers (``--quant int8`` / ``--quant int4``).

Every ``nn.Linear`` inside the decoder layers, and the lm_head, is replaced, one module at
a time, by a module that keeps its weight quantized in memory and runs torch's weight-only
CPU kernels with bfloat16 activations:

- ``int8`` -> :class:`Int8Linear`: int8 per output channel, symmetric (``scale = absmax /
  127``, no zero point), bfloat16 scales; ``torch._weight_int8pack_mm(x, w, scales)``.
- ``int4`` -> :class:`Int4Linear`: 4-bit, asymmetric, groups of 32 along the input
  (``w = (q - 8) * scale + zero``, bfloat16 scale and zero per group and output);
  ``torch._weight_int4pack_mm_for_cpu``. llama.cpp's Q4_0 and Q4_1 blocks are exactly that
  shape (32 weights, a step and a minimum), so a Q4_0 / Q4_1 GGUF's linears take the file's
  own codes, steps and minima (``Int4Linear.from_grid``, ``fabric.compute.gguf_grid``; only
  the step and zero are rounded to bfloat16); other weights are fitted group by group
  (``Int4Linear.from_linear``). A linear the int4 kernel cannot take (out_features not a
  multiple of 16, in_features not whole groups) falls back to int8.

Embeddings, norms, rotary embeddings, attention and the KV cache stay in bfloat16: a
quantized shard is loaded with ``dtype=torch.bfloat16`` (``load_shard(quant=...)`` does it),
because torch's weight-only kernels are fast with bfloat16 activations only. The lm_head stays
int8 under int4 (``LM_HEAD_SCHEME``; in SmolLM2's GGUF it is the Q8_0 token embedding) because
an int4 one lost greedy agreement with float32 at once. The measurements behind these choices (activation dtypes, fused projections, threads,
int8 against int4, agreement) are in docs/BENCHMARKS.md, "Quantized shards": figures belong
with the commands that made them, not in the code they shaped.

Memory: each linear is quantized as it is replaced, so the transient extra is one
linear's float copy. What remains: ``fabric.compute.models.load_shard`` first builds the whole shard
in bfloat16, and for a GGUF its loader dequantizes tensor by tensor into float32 arrays
that are all held until the shard is built; so a GGUF shard's load peak is still its
float32 size (a safetensors shard's, its bfloat16 size). Quantizing inside the loader,
tensor by tensor, would remove that peak. After quantizing, the freed heap is handed back
to the OS (``release_freed_memory``), else a node's RSS keeps the peak.

Tied embeddings: when the lm_head shares its weight with the token embedding (SmolLM2's
tail), the lm_head gets its own quantized copy and the embedding stays as it is.

Mixture-of-experts blocks whose experts are fused 3-D parameters (transformers 5's
Qwen3-MoE) are not ``nn.Linear`` and stay bfloat16; their attention linears are quantized.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import q8dot
from .heap import release_freed_memory

if TYPE_CHECKING:
    from .gguf_grid import FileGrid
    from .qblock import FileBlocks

SCHEMES = ("int8", "int4", "gguf")  # gguf: each GGUF tensor type on its own kernel (fabric.compute.gguf_grid)
LM_HEAD_SCHEME = {"int4": "int8", "gguf": "int8"}  # the lm_head's scheme under each scheme (default: the same)
INT4_GROUP = 32  # llama.cpp's Q4_0 / Q4_1 block: a Q4_1 GGUF's weights fit it again


class Int8Linear(nn.Module):
    """``y = x @ (w_int8 * scale[:, None]).T + bias``, computed with x in bfloat16 (returned in x's dtype).

    ``weight`` is int8 of shape (out, in), contiguous (the kernel refuses anything else);
    ``scales`` is bfloat16 of shape (out,). Both are frozen parameters (requires_grad
    False), so ``ShardWeights.parameter_bytes()`` and ``parameters()`` count them.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D int8 tensor, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.scales = nn.Parameter(scales.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w_int8, scales = quantize_weight(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w_int8, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_linear(x, self, lambda x2: torch._weight_int8pack_mm(x2, self.weight, self.scales))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this module computes with (for checks)."""
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _bf16_linear(x: torch.Tensor, layer: nn.Module, kernel) -> torch.Tensor:
    """Run a weight-only kernel on bfloat16 rows of ``x`` (..., in) and return (..., out)
    in x's dtype, adding ``layer.bias`` if it has one."""
    x2 = x.reshape(-1, layer.in_features)  # (rows, in)
    y = kernel(x2 if x.dtype == torch.bfloat16 else x2.to(torch.bfloat16))  # (rows, out)
    if layer.bias is not None:
        y = y + layer.bias
    return (y if x.dtype == torch.bfloat16 else y.to(x.dtype)).view(*x.shape[:-1], layer.out_features)


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weights (groups of ``group_size`` along the input):
    ``w = (q - 8) * scale + zero``, q in 0..15, scale and zero bfloat16 per (group, output),
    run by ``torch._weight_int4pack_mm_for_cpu`` with bfloat16 activations (returned in x's dtype).
    ``weight`` is the kernel's packed uint8 layout (out, in / 2)."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.weight = nn.Parameter(packed, requires_grad=False)  # uint8 (out, in / 2)
        self.scales_zeros = nn.Parameter(scales_zeros, requires_grad=False)  # bf16 (in / group, out, 2)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP) -> Int4Linear:
        """Each group's min..max in 16 steps (the weight's own range, re-rounded)."""
        out_f, in_f = linear.weight.shape
        w = linear.weight.detach().float().view(out_f, in_f // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.int32)
        return cls.packed(q.view(out_f, in_f), scale, zero, group_size, linear.bias)

    @classmethod
    def from_grid(cls, grid: FileGrid, bias: torch.Tensor | None = None) -> Int4Linear:
        """A GGUF's Q4_0 / Q4_1 blocks as the file stores them (``fabric.compute.gguf_grid``):
        its codes, scale = its step, zero = its minimum + 8 steps, rounded to bfloat16."""
        in_f = grid.codes.shape[1]
        zero = grid.minimum + 8 * grid.scale  # (out, groups): the kernel's (q - 8) * scale + zero
        return cls.packed(grid.codes.to(torch.int32), grid.scale, zero, in_f // grid.scale.shape[1], bias)

    @classmethod
    def packed(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None) -> Int4Linear:
        """From codes (out, in) in 0..15 and a scale and zero per (out, group): w = (q - 8) * scale + zero."""
        out_f, in_f = codes.shape
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()  # (groups, out, 2)
        return cls(packed, sz, in_f, out_f, group_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16_linear(x, self, lambda x2: torch._weight_int4pack_mm_for_cpu(
            x2, self.weight, self.group_size, self.scales_zeros))

    def dequantized(self) -> torch.Tensor:
        """The weight this module computes with, as float32 (rounded through bfloat16; for checks)."""
        q = torch._weight_int4pack_mm_for_cpu(  # unpack by multiplying the identity
            torch.eye(self.in_features, dtype=torch.bfloat16), self.weight, self.group_size,
            self.scales_zeros).float()  # (in, out)
        return q.T.contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int4 groups of {self.group_size}")


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (w_int8 (out, in), scales bf16 (out,)).

    The scales are rounded to bfloat16 *before* the weights are divided by them, so the
    int8 values are the best ones for the scales the kernel will actually use.
    """
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scales = (absmax / 127.0).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def int4_fits(linear: nn.Linear, group_size: int = INT4_GROUP) -> bool:
    """The int4 kernel needs in_features in whole groups and out_features a multiple of 16."""
    out_f, in_f = linear.weight.shape
    return in_f % group_size == 0 and out_f % 16 == 0


def _quantize_linear(linear: nn.Linear, scheme: str, grid: FileGrid | FileBlocks | str | None = None,
                     dot: bool = False) -> nn.Module:
    """``linear`` on ``scheme``'s kernel; ``grid`` is its place from the file
    (``fabric.compute.gguf_grid.placement_of``): a FileGrid, FileBlocks (the qmatmul kernel),
    KEEP (stays as it is) or None. ``dot``: 4-bit grids and int8 rows on the q8dot kernel."""
    from .gguf_grid import KEEP
    from .qblock import BlockLinear, FileBlocks

    if isinstance(grid, str) and grid == KEEP:
        return linear
    if isinstance(grid, FileBlocks):
        return BlockLinear(grid, linear.bias)
    if scheme in ("int4", "gguf") and grid is not None and int4_fits(linear):
        return q8dot.DotLinear.from_grid(grid, linear.bias) if dot else Int4Linear.from_grid(grid, linear.bias)
    if scheme == "int4" and int4_fits(linear):
        return Int4Linear.from_linear(linear)
    int8 = Int8Linear.from_linear(linear)  # int8, gguf's re-rounded types, or an int4 shape the kernel cannot take
    return on_dot_kernel(int8) if dot else int8


def on_dot_kernel(layer: Int8Linear) -> nn.Module:
    """``layer``'s int8 rows and scales on the q8dot kernel; the caller has decided it runs there
    (:func:`file_on_dot`)."""
    return q8dot.DotLinear.from_int8(layer.weight.data, layer.scales.data.float(),
                                     None if layer.bias is None else layer.bias.data)


def _swap_linears(module: nn.Module, scheme: str, grids: Mapping[nn.Module, FileGrid | str], dot: bool) -> int:
    """Replace every nn.Linear below ``module`` (one at a time); how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _quantize_linear(child, scheme, grids.get(child), dot))
            del child
            count += 1
        else:
            count += _swap_linears(child, scheme, grids, dot)
    return count


@torch.no_grad()
def quantize_modules(layers: Iterable[nn.Module], lm_head: nn.Module | None = None, scheme: str = "int8",
                     grids: Mapping[nn.Module, FileGrid | str] | None = None
                     ) -> tuple[list[nn.Module], nn.Module | None]:
    """Quantize decoder layers (in place, one by one) and an lm_head (returned new).

    ``grids``: linears whose weights a GGUF stores on a 4-bit grid (``fabric.compute.gguf_grid``);
    under int4 they keep it. ``lm_head`` may share its weight with the token embedding: the
    new Int8Linear holds its own int8 copy and never touches the shared float tensor. A GGUF's
    default mode (int4 or gguf with the file's grids) runs on the q8dot kernel (:func:`file_on_dot`).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    dot = grids is not None and file_on_dot(scheme)
    out = []
    for layer in layers:
        if isinstance(layer, nn.Linear):
            raise TypeError("pass decoder layers, not bare nn.Linear modules")
        _swap_linears(layer, scheme, grids or {}, dot)
        out.append(layer)
    head = None
    if lm_head is not None:
        # under int4 the lm_head stays int8 (LM_HEAD_SCHEME): measured, docs/BENCHMARKS.md
        head = lm_head
        if isinstance(lm_head, nn.Linear):
            head = _quantize_linear(lm_head, LM_HEAD_SCHEME.get(scheme, scheme), None, dot)
    return out, head


def file_on_dot(scheme: str | None) -> bool:
    """A GGUF's linears and lm_head under ``scheme`` run on the q8dot kernel: its default modes
    (int4 and gguf, the file's own grids), unless ``MESHNET_Q8DOT=0`` or it cannot be built."""
    return scheme in ("int4", "gguf") and q8dot.wanted()


def quantize(module, scheme: str = "int8", grids: Mapping[nn.Module, FileGrid | str] | None = None):
    """Quantize ``module`` in place and return it.

    ``module`` is a ``fabric.compute.models.ShardWeights`` (its decoder layers and lm_head), or a
    transformers ``*ForCausalLM`` (``model.model.layers`` and ``model.lm_head``: the
    single-process reference with the very same quantized weights). Embeddings and norms
    are left as they are. The caller loads the model in bfloat16. ``grids``: as
    :func:`quantize_modules` takes them.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if hasattr(module, "layers") and hasattr(module, "shard"):  # ShardWeights
        ordered = [module.layers[i] for i in sorted(module.layers)]
        _, module.lm_head = quantize_modules(ordered, module.lm_head, scheme, grids)
        release_freed_memory()
        return module
    inner = getattr(module, "model", None)
    if inner is not None and hasattr(inner, "layers") and hasattr(module, "lm_head"):
        _, head = quantize_modules(inner.layers, module.lm_head, scheme, grids)
        # an HF model re-ties lm_head to the embedding on some calls; untie for good
        if getattr(module.config, "tie_word_embeddings", False):
            module.config.tie_word_embeddings = False
            if hasattr(module, "_tied_weights_keys"):
                module._tied_weights_keys = None
        module.lm_head = head
        release_freed_memory()
        return module
    raise TypeError(f"cannot quantize a {type(module).__name__}: give ShardWeights or a *ForCausalLM model")


def quantized_layer_bytes(config, scheme: str) -> int:
    """Bytes one decoder layer holds under ``scheme`` (from the architecture, no weights):
    what ``fabric.compute.models.layer_bytes`` gives for float dtypes, for ``--memory`` planning."""
    from .empty import one_layer

    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    layer = one_layer(config)
    total, linear_params = 0, set()
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            out_f, in_f = m.weight.shape
            linear_params.add(id(m.weight))
            if scheme == "int4" and int4_fits(m):
                total += out_f * in_f // 2 + (in_f // INT4_GROUP) * out_f * 4  # packed + bf16 scale, zero
            else:
                total += out_f * in_f + out_f * 2  # int8 + bf16 scale
            if m.bias is not None:
                linear_params.add(id(m.bias))
                total += out_f * 2
    return total + sum(p.numel() * 2 for p in layer.parameters() if id(p) not in linear_params)
