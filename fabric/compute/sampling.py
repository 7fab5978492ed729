"""logits -> token. Seeded draws depend only on (seed, position), so a request replays
identically after a re-prefill or a failover onto other nodes."""
from __future__ import annotations

import hashlib

import torch

from ..wire.protocol import DraftDist, Sampling


def draw(seed: int, position: int, stream: str = "") -> float:
    """A uniform number in [0, 1) that is a pure function of (seed, position) and ``stream``
    (a second and third independent draw per position: a draft's, its acceptance test's)."""
    key = f"{seed}:{position}:{stream}" if stream else f"{seed}:{position}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def kept(logits: torch.Tensor, params: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a sampling request may pick from ``logits`` (vocab,), likeliest first, with
    their probabilities after temperature, top-k and top-p, not renormalized: (ids, probs)."""
    logits = logits.cpu()  # the draws are CPU float64 numbers
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
    return order, sorted_probs


def _pick(order: torch.Tensor, weights: torch.Tensor, u: float) -> int:
    """The token of ``order`` whose share of ``weights`` (not normalized) holds ``u`` in [0, 1)."""
    cdf = torch.cumsum(weights.double(), dim=0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])
    return int(order[min(index, len(order) - 1)])


def sample(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """Pick the token for ``position`` from ``logits`` (vocab,) float32, on any device."""
    if params.temperature == 0.0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy's argmax (the first maximum, as torch's) runs on this thread: torch's would wake
            # the OpenMP pool for one row, which on a busy 2-core machine cost ~3x as much (measured)
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    order, probs = kept(logits, params)
    return _pick(order, probs, draw(params.seed or 0, position))


def propose(logits: torch.Tensor, params: Sampling, position: int, limit: int) -> tuple[int, DraftDist]:
    """A draft model's token for ``position`` of a sampling request, and the distribution q it
    was drawn from: the request's own cut (temperature, top-k, top-p) of the draft's
    ``logits``, its ``limit`` likeliest tokens, renormalized (the tail's acceptance rule is
    exact for any q, as long as it is the one the draft was drawn from)."""
    order, probs = kept(logits, params)
    order, probs = order[:limit], probs[:limit].double()
    probs = probs / probs.sum()
    token = _pick(order, probs, draw(params.seed or 0, position, "draft"))
    return token, DraftDist(tuple(order.tolist()), tuple(probs.tolist()))


def accept(logits: torch.Tensor, params: Sampling, position: int, draft: int, q: DraftDist) -> int:
    """The standard acceptance rule for a draft drawn from ``q``: the token for ``position``
    is ``draft`` with probability min(1, p(draft) / q(draft)), else one drawn from
    norm(max(0, p - q)); either way it is distributed as p, the request's distribution over
    ``logits`` (vocab,). Greedy keeps the draft only where it is the argmax."""
    if params.temperature == 0.0:
        return sample(logits, params, position)
    order, probs = kept(logits, params)
    p = probs.double() / probs.double().sum()  # (n,) over order
    at = (order == draft).nonzero()
    p_draft = float(p[at[0, 0]]) if len(at) else 0.0
    if draw(params.seed or 0, position, "accept") * q.prob(draft) < p_draft:
        return draft
    dense = torch.zeros(logits.shape[-1], dtype=torch.float64)  # (vocab,): q, 0 off its ids
    ids = [(t, v) for t, v in zip(q.ids, q.probs) if t < len(dense)]
    dense[[t for t, _ in ids]] = torch.tensor([v for _, v in ids], dtype=torch.float64)
    q_on = dense[order]  # (n,)
    residual = (p - q_on).clamp(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q (to rounding): nothing to correct
        residual = p
    return _pick(order, residual, draw(params.seed or 0, position))
