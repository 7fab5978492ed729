#!/usr/bin/env python
"""A sampled token's cost at the tail: ``fabric.compute.sampling.sample`` against a draw that
sorts the whole vocabulary (the rule before 2026-12-07), on a real model's logits.

    python bench/sampling.py [--model smollm2-135m] [--positions 80] [--reps 5]

Gathers the logits of ``--positions`` positions of three chat replies, sampled at temperature
1 by one process holding the whole model (its default quantization, one thread), then times
both draws on each row for the OpenAI API's default (temperature 1) and two cuts, alternated
``--reps`` times: microseconds a token, their ratio, how often a draw had to sort the whole
vocabulary, and the mass the 256 likeliest tokens hold. Both draws must give the same tokens.
Then a draft model's acceptance (``sampling.accept``, its drafts ``propose``d from the same
logits with noise added, as another model's would be) against the same rule with the whole
vocabulary sorted every time (``CANDIDATES`` set to the vocabulary): microseconds a drafted
position, and the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fabric.compute import sampling  # noqa: E402
from fabric.wire.protocol import Sampling  # noqa: E402

PROMPTS = ["Tell me a story about the sea.", "Explain how a bicycle works.", "Write a poem about autumn leaves."]
CUTS = {"temperature 1 (OpenAI's default)": Sampling(temperature=1.0, seed=3),
        "temperature 0.7, top_p 0.9": Sampling(temperature=0.7, top_p=0.9, seed=3),
        "temperature 0.7, top_k 40": Sampling(temperature=0.7, top_k=40, seed=3)}


def gather(model: str, positions: int) -> list[torch.Tensor]:
    """Each position's logits (vocab,) of a sampled reply to every prompt."""
    from fabric.cli.memory_plan import picked_quant
    from fabric.compute.executor import ShardExecutor
    from fabric.compute.kv import KVStore
    from fabric.compute.models import load_config, load_shard, load_tokenizer, resolve
    from fabric.wire.shard import Shard

    torch.set_num_threads(1)
    source = resolve(model)
    layers = load_config(source).num_hidden_layers
    shard = Shard(0, layers - 1, layers)
    ex = ShardExecutor(load_shard(source, shard, progress=False, quant=picked_quant("auto", model, "cpu")), KVStore())
    tokenizer = load_tokenizer(source)
    rows = []
    for n, text in enumerate(PROMPTS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out, pos = ex.run(f"s{n}", 0, layers - 1, ids, 0), ids.shape[1]
        for _ in range(positions):
            rows.append(out.logits.reshape(-1, out.logits.shape[-1])[-1].clone())
            token = sampling.sample(rows[-1], CUTS["temperature 1 (OpenAI's default)"], pos)
            out, pos = ex.run(f"s{n}", 0, layers - 1, torch.tensor([[token]]), pos), pos + 1
    return rows


def whole_sort(logits: torch.Tensor, params: Sampling, position: int) -> int:
    """The same rule, on the whole vocabulary sorted (``sampling``'s fallback, every time)."""
    probs = sampling._probs(logits, params)
    cut = bool(params.top_k) or params.top_p < 1.0
    order, ranked, _ = sampling._cut(probs, sampling._likeliest(probs, probs.numel()), params)
    target = sampling.draw(params.seed, position) * sampling._total(probs, order if cut else None)
    return sampling._crossing(order, torch.cumsum(ranked.double(), dim=0), target)


def timed(draw, rows: list[torch.Tensor], params: Sampling) -> tuple[float, list[int]]:
    began = time.perf_counter()
    tokens = [draw(row, params, pos) for pos, row in enumerate(rows)]
    return (time.perf_counter() - began) / len(rows), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--positions", type=int, default=80, help="positions of each of the three replies")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = gather(args.model, args.positions)
    held = sorted(float(torch.topk(torch.softmax(r.float(), -1), sampling.CANDIDATES).values.sum()) for r in rows)
    print(f"{len(rows)} positions of {args.model} (vocabulary {rows[0].numel():,}); the {sampling.CANDIDATES} "
          f"likeliest hold a median {statistics.median(held):.3f} of the mass at temperature 1 (10th percentile "
          f"{held[len(held) // 10]:.3f})")
    for name, params in CUTS.items():
        new, old = [], []
        for _ in range(args.reps):  # alternated: the machine's drift falls on both
            took, tokens = timed(sampling.sample, rows, params)
            new.append(took)
            took, reference = timed(whole_sort, rows, params)
            old.append(took)
            if tokens != reference:
                raise SystemExit(f"{name}: the draws differ")
        print(f"{name}: {statistics.median(new) * 1e6:.0f} us a token against {statistics.median(old) * 1e6:.0f} "
              f"sorting the whole vocabulary ({statistics.median(new) / statistics.median(old):.2f}x); "
              f"{sorted_whole(rows, params):.1%} of draws sorted it; the same tokens")
    acceptance(rows, CUTS["temperature 1 (OpenAI's default)"], args.reps)


def acceptance(rows: list[torch.Tensor], params: Sampling, reps: int) -> None:
    """``accept`` on the likeliest tokens against ``accept`` on the whole vocabulary sorted."""
    noise = torch.Generator().manual_seed(1)
    drafted = [sampling.propose(r.float() + torch.randn(r.shape, generator=noise), params, pos, 64)
               for pos, r in enumerate(rows)]

    def accept(row: torch.Tensor, params: Sampling, pos: int) -> int:
        return sampling.accept(row, params, pos, *drafted[pos])
    new, old, candidates = [], [], sampling.CANDIDATES
    for _ in range(reps):
        took, tokens = timed(accept, rows, params)
        new.append(took)
        sampling.CANDIDATES = rows[0].numel()  # every draw on the whole order
        try:
            took, reference = timed(accept, rows, params)
        finally:
            sampling.CANDIDATES = candidates
        old.append(took)
        if tokens != reference:
            raise SystemExit("the acceptances differ")
    kept = sum(t == d for t, (d, _) in zip(tokens, drafted)) / len(rows)
    print(f"a draft's acceptance at temperature {params.temperature:g}: {statistics.median(new) * 1e6:.0f} us a "
          f"position against {statistics.median(old) * 1e6:.0f} sorting the whole vocabulary "
          f"({statistics.median(new) / statistics.median(old):.2f}x); {kept:.0%} of drafts kept; the same tokens")


def sorted_whole(rows: list[torch.Tensor], params: Sampling) -> float:
    """The share of ``sample``'s draws that sorted the whole vocabulary (counted, not timed)."""
    likeliest, whole = sampling._likeliest, []
    sampling._likeliest = lambda probs, k: whole.append(k >= probs.numel()) or likeliest(probs, k)
    try:
        draws = []
        for pos, row in enumerate(rows):
            whole.clear()
            sampling.sample(row, params, pos)
            draws.append(any(whole))
    finally:
        sampling._likeliest = likeliest
    return sum(draws) / len(draws)


if __name__ == "__main__":
    main()
