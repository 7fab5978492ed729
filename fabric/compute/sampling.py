"""logits -> token. Seeded draws depend only on (seed, position), so a request replays
identically after a re-prefill or a failover onto other nodes.

A sampling request's token is defined on the vocabulary in one order: likeliest first, ties
by token id (a stable sort), tokens of probability 0 left out. Top-k keeps the first k of it,
top-p the shortest prefix whose mass reaches p; the draw u in [0, 1) picks the first token
whose running sum (float64, in that order) exceeds u times the kept tokens' total (float64,
summed in token-id order). A draw needs only the start of the order: the likeliest
CANDIDATES tokens, taken without sorting the rest, hold the answer whenever the kept mass it
needs lies among them (91% of SmolLM2's draws at temperature 1, `bench/sampling.py`); else
16 times as many, else the whole vocabulary sorted. Each gives the same token: the
candidates are the first tokens of the whole order, in its order. (A full sort of SmolLM2's
49,152 tokens took 4.2 ms a token here, ten times the rest of a draw.) A draft model's
token is kept or replaced (``accept``) on the same start of the order."""
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


CANDIDATES = 256  # the likeliest tokens a draw looks among before it sorts the whole vocabulary


def _probs(logits: torch.Tensor, params: Sampling) -> torch.Tensor:
    logits = logits.cpu()  # the draws are CPU float64 numbers
    return torch.softmax(logits.float() / params.temperature, dim=-1)


def _likeliest(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, bool]:
    """The first ids of the order (likeliest first, ties by id; a token of probability 0, which
    no draw can pick, is never in it): at least ``k`` of them, or every one there is, and every
    token as likely as the k-th; and whether that is every token of the order."""
    if k >= probs.numel():
        order = torch.sort(probs, descending=True, stable=True).indices
        drawable = order[probs[order] > 0]
        return (drawable if drawable.numel() else order), True  # none: not a number anywhere
    top = torch.topk(probs, k + 1)
    if top.values[k - 1] > top.values[k]:  # the k likeliest are these k, whatever order topk gave ties
        ids, every = torch.sort(top.indices[:k]).values, bool(top.values[k] == 0)
    elif top.values[k - 1] > 0:  # tokens past them tie with the k-th: take every one of them
        ids, every = (probs >= top.values[k - 1]).nonzero().view(-1), False
    else:  # fewer than k tokens can be drawn at all (a grammar's mask): these are all
        ids, every = (probs > 0).nonzero().view(-1), True
    if not ids.numel():  # not a number anywhere (a broken model's logits): the whole order decides
        return _likeliest(probs, probs.numel())
    return ids[torch.sort(probs[ids], descending=True, stable=True).indices], every  # ids ascending: ties by id


def _cut(probs: torch.Tensor, likeliest: tuple[torch.Tensor, bool],
         params: Sampling) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Top-k and top-p on ``likeliest`` (``_likeliest``'s answer): (ids, their probabilities,
    whether the kept tokens end within them)."""
    order, whole = likeliest
    ranked = probs[order]
    if params.top_k and params.top_k <= order.numel():
        order, ranked, whole = order[: params.top_k], ranked[: params.top_k], True
    if params.top_p < 1.0:
        # keep the shortest prefix whose mass reaches top_p (always at least one token)
        keep = torch.cumsum(ranked, dim=0) - ranked < params.top_p
        whole = whole or not bool(keep.all())
        order, ranked = order[keep], ranked[keep]
    return order, ranked, whole


def kept(logits: torch.Tensor, params: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a sampling request may pick from ``logits`` (vocab,), likeliest first, with
    their probabilities after temperature, top-k and top-p, not renormalized: (ids, probs)."""
    probs = _probs(logits, params)
    order, ranked, _ = _cut(probs, _likeliest(probs, probs.numel()), params)
    return order, ranked


def _total(probs: torch.Tensor, ids: torch.Tensor | None) -> float:
    """The kept tokens' mass (all of them: None), summed in float64 in token-id order (one
    running sum: the same bits on any machine, whatever its threads)."""
    mass = probs.double() if ids is None else probs[torch.sort(ids).values].double()
    return float(torch.cumsum(mass, dim=0)[-1])


def _pick(order: torch.Tensor, weights: torch.Tensor, u: float) -> int:
    """The token of ``order`` whose share of ``weights`` (not normalized) holds ``u`` in [0, 1)."""
    cdf = torch.cumsum(weights.double(), dim=0)
    return _crossing(order, cdf, u * float(cdf[-1]))


def _crossing(order: torch.Tensor, cdf: torch.Tensor, target: float) -> int:
    """The token of ``order`` where the running sum ``cdf`` first exceeds ``target`` (the last
    where none does)."""
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True)[0])
    return int(order[min(index, len(order) - 1)])


def _prefixes(probs: torch.Tensor, params: Sampling):
    """The kept order's start, cut (``_cut``'s answers), wider each time: among the CANDIDATES
    likeliest, then 16 times as many, then the whole order, which ends every cut."""
    for k in (CANDIDATES, 16 * CANDIDATES, probs.numel()):
        yield _cut(probs, _likeliest(probs, max(k, params.top_k)), params)


def _cuts(params: Sampling) -> bool:
    """Does the request keep fewer tokens than every drawable one (top-k, top-p)?"""
    return bool(params.top_k) or params.top_p < 1.0


def _sampled(probs: torch.Tensor, params: Sampling, u: float) -> int:
    """The draw ``u``'s token (the module's docstring): among the CANDIDATES likeliest where the
    running sum crosses its target there, else among 16 times as many, else on the whole order."""
    cut = _cuts(params)
    uncut = None if cut else u * _total(probs, None)  # the target where every token is kept
    for order, ranked, ends in _prefixes(probs, params):
        if cut and not ends:
            continue  # the nucleus goes on past these
        target = u * _total(probs, order) if cut else uncut
        cdf = torch.cumsum(ranked.double(), dim=0)
        if ends or float(cdf[-1]) > target:
            return _crossing(order, cdf, target)
    raise AssertionError("the whole vocabulary's order ends every draw")


def sample(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """Pick the token for ``position`` from ``logits`` (vocab,) float32, on any device."""
    if params.temperature == 0.0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy's argmax (the first maximum, as torch's) runs on this thread: torch's would wake
            # the OpenMP pool for one row, which on a busy 2-core machine cost ~3x as much (measured)
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    return _sampled(_probs(logits, params), params, draw(params.seed or 0, position))


def propose(logits: torch.Tensor, params: Sampling, position: int, limit: int) -> tuple[int, DraftDist]:
    """A draft model's token for ``position`` of a sampling request, and the distribution q it
    was drawn from: the request's own cut (temperature, top-k, top-p) of the draft's
    ``logits``, its ``limit`` likeliest tokens, renormalized (the tail's acceptance rule is
    exact for any q, as long as it is the one the draft was drawn from)."""
    probs = _probs(logits, params)
    order, ranked, _ = _cut(probs, _likeliest(probs, max(limit, params.top_k)), params)  # the kept order's start
    order, probs = order[:limit], ranked[:limit].double()
    probs = probs / probs.sum()
    token = _pick(order, probs, draw(params.seed or 0, position, "draft"))
    return token, DraftDist(tuple(order.tolist()), tuple(probs.tolist()))


def accept(logits: torch.Tensor, params: Sampling, position: int, draft: int, q: DraftDist) -> int:
    """The standard acceptance rule for a draft drawn from ``q``: the token for ``position``
    is ``draft`` with probability min(1, p(draft) / q(draft)), else one drawn from
    norm(max(0, p - q)); either way it is distributed as p, the request's distribution over
    ``logits`` (vocab,). Greedy keeps the draft only where it is the argmax.

    Exactly (docs/PROTOCOL.md §4): with T the kept tokens' mass (``_total``) and P their
    probabilities before normalizing, p(draft) = P(draft) / T, 0 where it is not kept. The
    residual of a kept token is max(0, P - q T) in the kept order, and its total R is T less
    min(P, q T) of each of q's kept ids, in id order (float64); the draw u picks the first
    token whose running sum of residuals exceeds u R, read among the likeliest tokens as
    ``sample`` does (the whole order only where the crossing lies past them). Where R is not
    above 0 (p and q agree to rounding), the token is ``sample``'s."""
    if params.temperature == 0.0:
        return sample(logits, params, position)
    probs = _probs(logits, params)
    seed, cut, prefixes = params.seed or 0, _cuts(params), _prefixes(probs, params)
    order, ranked, ends = next(prefixes)
    while cut and not ends:  # a cut's kept tokens, all of them: the draft's p needs their mass
        order, ranked, ends = next(prefixes)
    total = _total(probs, order if cut else None)
    kept_ids = set(order.tolist()) if cut else None

    def is_kept(token: int) -> bool:
        return token in kept_ids if cut else 0 <= token < probs.numel() and float(probs[token]) > 0.0
    if not total > 0.0:  # not a number anywhere: the plain draw decides
        return _sampled(probs, params, draw(seed, position))
    p_draft = float(probs[draft]) / total if is_kept(draft) else 0.0
    if draw(seed, position, "accept") * q.prob(draft) < p_draft:
        return draft
    owed = {t: v * total for t, v in zip(q.ids, q.probs) if is_kept(t)}  # q T of each of q's kept ids
    residual = total
    for t in sorted(owed):
        residual -= min(float(probs[t]), owed[t])
    if not residual > 0.0:
        return _sampled(probs, params, draw(seed, position))
    target, dense = draw(seed, position) * residual, torch.zeros(probs.numel(), dtype=torch.float64)
    dense[list(owed)] = torch.tensor(list(owed.values()), dtype=torch.float64)
    while True:  # the whole order, the last prefix, ends every draw
        cdf = torch.cumsum((ranked.double() - dense[order]).clamp(min=0.0), dim=0)
        if ends or float(cdf[-1]) > target:
            return _crossing(order, cdf, target)
        order, ranked, ends = next(prefixes)
