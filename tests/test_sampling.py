"""The tail's token choice: greedy picks the first maximum, seeded draws replay, and the
acceptance rule of a draft model's tokens is the one docs/PROTOCOL.md §4 states."""
import torch

from fabric.compute.sampling import draw, sample
from fabric.wire.protocol import Sampling

GREEDY = Sampling()


def test_greedy_is_torch_argmax_for_every_row_of_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 49152)  # the tail hands sample() rows of its batch: views, not copies
    assert [sample(row, GREEDY, 5) for row in logits] == logits.argmax(-1).tolist()


def test_greedy_ties_go_to_the_first_maximum_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = torch.zeros(100, dtype=dtype)
        logits[[17, 42, 99]] = 3.0
        assert sample(logits, GREEDY, 0) == 17 == int(torch.argmax(logits)), dtype


def test_seeded_draws_replay_and_narrow_to_greedy():
    torch.manual_seed(1)
    logits = torch.randn(1000)
    hot = Sampling(temperature=1.0, seed=7)
    assert [sample(logits, hot, p) for p in range(20)] == [sample(logits.clone(), hot, p) for p in range(20)]
    assert len({sample(logits, hot, p) for p in range(50)}) > 1  # the draws do differ by position
    assert draw(7, 3) == draw(7, 3) != draw(8, 3)
    best = int(torch.argmax(logits))
    assert sample(logits, Sampling(temperature=1.0, top_k=1, seed=3), 9) == best
    assert sample(logits, Sampling(temperature=1.0, top_p=1e-6, seed=3), 9) == best


def whole_order(logits: torch.Tensor, params: Sampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The kept tokens on the whole vocabulary sorted: likeliest first (ties by id), top-k, top-p:
    (probs, order, their probabilities, their mass summed in id order)."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    order = torch.sort(probs, descending=True, stable=True).indices
    order = order[probs[order] > 0]  # a token of probability 0 is never drawn
    ranked = probs[order]
    if params.top_k:
        order, ranked = order[: params.top_k], ranked[: params.top_k]
    if params.top_p < 1.0:
        keep = torch.cumsum(ranked, dim=0) - ranked < params.top_p
        order, ranked = order[keep], ranked[keep]
    return probs, order, ranked, float(torch.cumsum(probs[torch.sort(order).values].double(), dim=0)[-1])


def reference(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """The draw as the module defines it, on the whole vocabulary: the running sum of the kept
    order against u times the kept mass summed in id order."""
    _, order, ranked, total = whole_order(logits, params)
    cdf = torch.cumsum(ranked.double(), dim=0)
    target = torch.tensor([draw(params.seed or 0, position) * total], dtype=torch.float64)
    return int(order[min(int(torch.searchsorted(cdf, target, right=True)[0]), len(order) - 1)])


def whole_sorts(monkeypatch) -> list[bool]:
    """From now on, for each look at the likeliest tokens: whether it sorted the whole vocabulary."""
    import fabric.compute.sampling as sampling

    sorted_whole, likeliest = [], sampling._likeliest

    def counted(probs: torch.Tensor, k: int):
        order, every = likeliest(probs, k)
        sorted_whole.append(k >= probs.numel() or order.numel() == probs.numel())
        return order, every
    monkeypatch.setattr(sampling, "_likeliest", counted)
    return sorted_whole


def test_a_draw_among_the_likeliest_tokens_is_the_draw_on_the_whole_vocabulary(monkeypatch):
    """Peaked rows (a trained model's), flat ones (a random model's: most draws land past the
    candidates), ties, masks (a grammar's five tokens) and a small vocabulary, under every kind
    of cut: the token is the one the whole sorted vocabulary gives. And the draws of a peaked
    row, or of five tokens a grammar allows, never sort the whole vocabulary (4 ms a token on
    SmolLM2's 49,152)."""
    torch.manual_seed(2)
    vocab = 49152
    masked, grammar = torch.full((vocab,), float("-inf")), torch.full((vocab,), float("-inf"))
    masked[torch.randperm(vocab)[:500]] = torch.randn(500)
    grammar[[7, 300, 301, 9000, 40000]] = torch.tensor([1.0, 2.0, 2.0, 0.5, 3.0])  # five tokens a grammar allows
    rows = {"peaked": torch.randn(vocab) * 6, "flat": torch.randn(vocab) * 0.5, "grammar": grammar,
            "ties": torch.randint(0, 4, (vocab,)).float(), "masked": masked, "small": torch.randn(50) * 3}
    cuts = [Sampling(temperature=t, top_k=k, top_p=p, seed=11) for t in (0.6, 1.0, 1.7)
            for k in (0, 1, 40, 300) for p in (1.0, 0.9, 0.3, 1e-6)]
    for name, logits in rows.items():
        for params in cuts:
            got = [sample(logits, params, pos) for pos in range(12)]
            assert got == [reference(logits, params, pos) for pos in range(12)], (name, params)

    sorted_whole = whole_sorts(monkeypatch)
    for pos in range(200):
        assert sample(rows["grammar"], Sampling(temperature=1.0, seed=5), pos) in (7, 300, 301, 9000, 40000)
        sample(rows["peaked"], Sampling(temperature=1.0, seed=5), pos)
    assert sorted_whole == [False] * 400


def test_a_drafts_distribution_is_the_start_of_the_kept_order():
    """``propose`` (a draft model's token and q) reads only the likeliest tokens: the same q and
    token as the whole kept order's first ``limit``, renormalized."""
    from fabric.compute.sampling import _pick, kept, propose

    torch.manual_seed(3)
    for logits in (torch.randn(49152) * 6, torch.randn(49152) * 0.5, torch.randint(0, 3, (49152,)).float()):
        for params in (Sampling(temperature=1.0, seed=4), Sampling(temperature=0.8, top_p=0.5, seed=4),
                       Sampling(temperature=1.3, top_k=20, seed=4)):
            order, probs = kept(logits, params)
            order, probs = order[:64], probs[:64].double() / probs[:64].double().sum()
            want = _pick(order, probs, draw(4, 9, "draft"))
            token, q = propose(logits, params, 9, 64)
            assert (token, q.ids, q.probs) == (want, tuple(order.tolist()), tuple(probs.tolist())), params


def reference_accept(logits: torch.Tensor, params: Sampling, position: int, draft: int, q) -> int:
    """The acceptance rule as docs/PROTOCOL.md §4 states it, on the whole vocabulary sorted."""
    probs, order, ranked, total = whole_order(logits, params)
    kept = set(order.tolist())
    p_draft = float(probs[draft]) / total if draft in kept else 0.0
    if draw(params.seed or 0, position, "accept") * q.prob(draft) < p_draft:
        return draft
    owed = {t: v * total for t, v in zip(q.ids, q.probs) if t in kept}
    residual = total
    for t in sorted(owed):
        residual -= min(float(probs[t]), owed[t])
    if residual <= 0.0:
        return reference(logits, params, position)
    owed_here = torch.tensor([owed.get(t, 0.0) for t in order.tolist()], dtype=torch.float64)
    cdf = torch.cumsum((ranked.double() - owed_here).clamp(min=0.0), dim=0)
    target = torch.tensor([draw(params.seed or 0, position) * residual], dtype=torch.float64)
    return int(order[min(int(torch.searchsorted(cdf, target, right=True)[0]), len(order) - 1)])


def test_a_drafts_acceptance_among_the_likeliest_tokens_is_the_rule_on_the_whole_vocabulary(monkeypatch):
    """A draft model's token kept or replaced (``accept``) as the rule on the whole sorted
    vocabulary gives, for drafts from a near and a far distribution, a draft outside the kept
    tokens and one past the vocabulary, under every kind of cut; and for a peaked row (a
    trained model's) the whole vocabulary is never sorted (4 ms a position on SmolLM2's)."""
    import fabric.compute.sampling as sampling
    from fabric.compute.sampling import accept, propose

    torch.manual_seed(4)
    vocab = 49152
    rows = {"peaked": torch.randn(vocab) * 6, "flat": torch.randn(vocab) * 0.5,
            "ties": torch.randint(0, 4, (vocab,)).float(), "small": torch.randn(50) * 3}
    cuts = [Sampling(temperature=t, top_k=k, top_p=p, seed=13) for t in (0.7, 1.0)
            for k in (0, 40) for p in (1.0, 0.9)]
    outcomes = set()
    for name, logits in rows.items():
        near, far = logits + torch.randn(logits.shape) * 0.3, torch.randn(logits.shape) * 4
        for params in cuts:
            for pos in range(6):
                for draft, q in (propose(near, params, pos, 64), propose(far, params, pos, 64),
                                 (len(logits) + 5, sampling.DraftDist((len(logits) + 5,), (1.0,)))):
                    got = accept(logits, params, pos, draft, q)
                    assert got == reference_accept(logits, params, pos, draft, q), (name, params, pos, draft)
                    outcomes.add(got == draft)
    assert outcomes == {True, False}  # drafts were kept and replaced

    sorted_whole = whole_sorts(monkeypatch)
    peaked, hot = rows["peaked"], Sampling(temperature=1.0, seed=5)
    for pos in range(100):
        accept(peaked, hot, pos, *propose(peaked + torch.randn(vocab), hot, pos, 64))
    assert sorted_whole and not any(sorted_whole)
