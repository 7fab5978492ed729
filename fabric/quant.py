"""Weight-only int8 quantization of a shard's linear layers (``--quant int8``).

Every ``nn.Linear`` inside the decoder layers, and the lm_head, becomes an
:class:`Int8Linear`: weights int8, per output channel, symmetric (``scale = absmax / 127``,
zero point 0), scales bfloat16; the forward pass is torch's weight-only kernel
``torch._weight_int8pack_mm(x_bf16, w_int8, scales_bf16)``. Activations, norms,
embeddings, attention and the KV cache stay in bfloat16, so a quantized shard is loaded
with ``dtype=torch.bfloat16``.

Measured on the 2-core dev machine (torch 2.13 CPU, 2 threads, one token at a time):
the kernel only has a fast path for bfloat16 activations (float32 or float16 activations
fall back to a path 10-25x slower), and for those shapes it is 1.1-2x faster than a
float32 ``F.linear`` and 2-3x faster than a bfloat16 one. The torch int4 kernel
(``_weight_int4pack_mm_for_cpu``) was within 10-20 % of int8 on SmolLM2's shapes and no
faster on the lm_head, so no int4 scheme is offered: it would cost quality for little.

Memory: modules are quantized one at a time, each weight converted in place of the one
it replaces, so the only transient extra is one linear's float copy. What remains: the
loader (``fabric.models.load_shard``) still materializes the whole shard in the load
dtype (bfloat16) before quantization; for a GGUF it dequantizes tensor by tensor into
float32 numpy arrays, all of which are held until the shard is built, so a GGUF shard's
peak is its float32 size, a safetensors shard's peak is its bfloat16 size. Streaming
quantization into the loader would remove that peak.

Tied embeddings: when the lm_head shares its weight with the token embedding (the tail
of SmolLM2 holds both), the lm_head gets its own int8 copy and the embedding stays as it
is; the shared float weight is then kept only if the embedding needs it.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

SCHEMES = ("int8", "int4")
INT4_GROUP = 32  # llama.cpp's Q4_0 / Q4_1 block: a Q4_1 GGUF's weights fit it again


class Int8Linear(nn.Module):
    """``y = x @ (w_int8 * scale[:, None]).T + bias``, with x in bfloat16.

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
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w_int8, scales = quantize_weight(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w_int8, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)
        if dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        if dtype != torch.bfloat16:
            y = y.to(dtype)
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this module computes with (for checks)."""
        return self.weight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weights (groups of ``group_size`` along the input):
    ``w = (q - 8) * scale + zero``, q in 0..15, scale and zero bfloat16 per (group, output),
    run by ``torch._weight_int4pack_mm_for_cpu`` with bfloat16 activations."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, in_features: int, out_features: int,
                 group_size: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.weight = nn.Parameter(packed, requires_grad=False)  # uint8 (out, in / 2)
        self.scales_zeros = nn.Parameter(scales_zeros, requires_grad=False)  # bf16 (in / group, out, 2)
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = INT4_GROUP) -> "Int4Linear":
        out_f, in_f = linear.weight.shape
        w = linear.weight.detach().float().view(out_f, in_f // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        q = torch.round((w - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.view(out_f, in_f), 1)
        sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
        return cls(packed, sz, in_f, out_f, group_size, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features)
        if dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        if dtype != torch.bfloat16:
            y = y.to(dtype)
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this module computes with (for checks)."""
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


def _quantize_linear(linear: nn.Linear, scheme: str) -> nn.Module:
    if scheme == "int4" and int4_fits(linear):
        return Int4Linear.from_linear(linear)
    return Int8Linear.from_linear(linear)  # int8, or an int4 shape the kernel cannot take


def _swap_linears(module: nn.Module, scheme: str) -> int:
    """Replace every nn.Linear below ``module`` (one at a time); how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _quantize_linear(child, scheme))
            del child
            count += 1
        else:
            count += _swap_linears(child, scheme)
    return count


@torch.no_grad()
def quantize_modules(layers: Iterable[nn.Module], lm_head: nn.Module | None = None,
                     scheme: str = "int8") -> tuple[list[nn.Module], nn.Module | None]:
    """Quantize decoder layers (in place, one by one) and an lm_head (returned new).

    ``lm_head`` may share its weight with the token embedding: the new Int8Linear holds
    its own int8 copy and never touches the shared float tensor.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    out = []
    for layer in layers:
        if isinstance(layer, nn.Linear):
            raise TypeError("pass decoder layers, not bare nn.Linear modules")
        _swap_linears(layer, scheme)
        out.append(layer)
    head = None
    if lm_head is not None:
        # the lm_head stays int8 under int4 too: it is measured, see the module docstring
        head = Int8Linear.from_linear(lm_head) if isinstance(lm_head, nn.Linear) else lm_head
    return out, head


def quantize(module, scheme: str = "int8"):
    """Quantize ``module`` in place and return it.

    ``module`` is a ``fabric.models.ShardWeights`` (its decoder layers and lm_head), or a
    transformers ``*ForCausalLM`` (``model.model.layers`` and ``model.lm_head``: the
    single-process reference with the very same quantized weights). Embeddings and norms
    are left as they are. The caller loads the model in bfloat16.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if hasattr(module, "layers") and hasattr(module, "shard"):  # ShardWeights
        ordered = [module.layers[i] for i in sorted(module.layers)]
        _, module.lm_head = quantize_modules(ordered, module.lm_head, scheme)
        return module
    inner = getattr(module, "model", None)
    if inner is not None and hasattr(inner, "layers") and hasattr(module, "lm_head"):
        _, head = quantize_modules(inner.layers, module.lm_head, scheme)
        # an HF model re-ties lm_head to the embedding on some calls; untie for good
        if getattr(module.config, "tie_word_embeddings", False):
            module.config.tie_word_embeddings = False
            if hasattr(module, "_tied_weights_keys"):
                module._tied_weights_keys = None
        module.lm_head = head
        return module
    raise TypeError(f"cannot quantize a {type(module).__name__}: give ShardWeights or a *ForCausalLM model")


def load_quantized_reference(directory, *, gguf_file: str | None = None, scheme: str = "int8"):
    """Single-process reference: ``AutoModelForCausalLM`` in bfloat16, quantized like a shard."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.bfloat16)
    return quantize(model.eval(), scheme)


def quantized_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of every parameter and buffer of ``modules`` (int8 weights, scales, floats left)."""
    seen = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
