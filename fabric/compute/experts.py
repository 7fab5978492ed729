"""Mixture-of-experts layers whose result for a token does not depend on the tokens beside it. No sockets.

transformers runs an MoE layer's experts as grouped or batched matmuls over the tokens routed
to each expert, so an expert sees as many rows as tokens chose it: one in a decode step, 17
in one prefill chunk, 30 in another. A bfloat16 GEMM picks its kernel, and so its rounding,
by the row count (fabric/compute/attention.py found the same for attention), so a token's
expert output, and the text, depended on what the token was computed beside.

``experts`` runs each expert on its tokens padded with zero rows to whole blocks of
``attention.ROW_BLOCK``, the row counts whose kernels agree row for row, and adds each
token's experts in expert order, as transformers' eager path does. It is the default mode's
experts wherever its attention is (``models._shard_weights``).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fabric.compute.attention import ROW_BLOCK

NAME = "meshnet_invariant"


def experts(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states (tokens, hidden); top_k_index and top_k_weights (tokens, k). Returns (tokens, hidden)."""
    out = torch.zeros_like(hidden_states)
    for expert in torch.unique(top_k_index).tolist():  # ascending: each token adds its experts in order
        if expert >= module.num_experts:  # a slot another rank holds
            continue
        token, slot = torch.where(top_k_index == expert)
        rows = _whole_blocks(hidden_states[token])
        if module.has_gate:
            part = module._apply_gate(_linear(module, rows, module.gate_up_proj, "gate_up_proj_bias", expert))
        else:
            part = module.act_fn(_linear(module, rows, module.up_proj, "up_proj_bias", expert))
        part = _linear(module, part, module.down_proj, "down_proj_bias", expert)[:len(token)]
        if module.has_post_expert_norm:
            part = module.post_expert_norm(part)
        out.index_add_(0, token, (part * top_k_weights[token, slot, None]).to(out.dtype))
    return out


def _linear(module, rows: torch.Tensor, weight: torch.Tensor, bias: str, expert: int) -> torch.Tensor:
    """``rows`` through one expert's projection, however the layer stores it."""
    w = weight[expert]
    b = getattr(module, bias)[expert] if module.has_bias else None
    return rows @ w + (b if b is not None else 0) if module.is_transposed else F.linear(rows, w, b)


def _whole_blocks(rows: torch.Tensor) -> torch.Tensor:
    extra = -rows.shape[0] % ROW_BLOCK
    return F.pad(rows, (0, 0, 0, extra)) if extra else rows


ALL_EXPERTS_FUNCTIONS.register(NAME, experts)
