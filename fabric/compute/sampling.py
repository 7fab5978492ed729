"""logits -> token. Seeded draws depend only on (seed, position), so a request replays
identically after a re-prefill or a failover onto other nodes."""
from __future__ import annotations

import hashlib

import torch

from ..wire.protocol import Sampling


def draw(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """Pick the token for ``position`` from ``logits`` (vocab,) float32, on any device."""
    if params.temperature == 0.0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy's argmax (the first maximum, as torch's) runs on this thread: torch's would wake
            # the OpenMP pool for one row, which on a busy 2-core machine cost ~3x as much (measured)
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    logits = logits.cpu()  # the draw below is a CPU float64 number
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    if params.top_k:
        sorted_probs = sorted_probs[: params.top_k]
        order = order[: params.top_k]
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep = before < params.top_p
        sorted_probs, order = sorted_probs[keep], order[keep]
    cdf = torch.cumsum(sorted_probs.double(), dim=0)
    u = draw(params.seed or 0, position) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return int(order[min(index, len(order) - 1)])
