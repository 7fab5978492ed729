"""Sliding-window KV on every hop: a local-attention layer keeps only its window (and a
named slack), in prefill slices, in KV kept for reuse by a later request, and in a
re-prefill after a miss; the tokens stay those of transformers' float32 ``generate()``.

The tiny Gemma 2 and Gemma 3 models are GGUF files (tests/gguf_models.py: window 8, Gemma 2
alternating sliding and full layers, Gemma 3 every sixth layer full), loaded per shard as a
node loads them and by transformers as the reference. Every split below puts sliding and
full layers on both shards, and the tail shard never holds layer 0.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fabric.compute.cache import ROOM, SLACK, WindowLayer
from fabric.compute.executor import CacheMissError, Chunk, ShardExecutor, Step
from fabric.compute.kv import KVStore
from fabric.compute.models import load_config, load_shard, resolve
from fabric.wire.shard import Shard
from tests.gguf_models import SLIDING_WINDOW, write_gguf
from tests.tiny_models import assert_clear_lead

LAYERS = {"gemma2": 4, "gemma3": 12}  # gemma3: layers 5 and 11 are the full ones
PROMPT = [(7 * i * i + 3 * i + 5) % 311 + 3 for i in range(40)]  # well past the window of 8
BOUND = SLIDING_WINDOW - 1 + SLACK + ROOM  # positions a sliding layer's buffer holds at most


@pytest.fixture(scope="module", params=sorted(LAYERS))
def model(request, tmp_path_factory) -> Path:
    family = request.param
    return write_gguf(family, tmp_path_factory.mktemp(family), "F32", num_layers=LAYERS[family])


def hops(model: Path) -> tuple[ShardExecutor, ShardExecutor]:
    source = resolve(str(model))
    n = load_config(source, None).num_hidden_layers
    return (ShardExecutor(load_shard(source, Shard(0, n // 2 - 1, n), progress=False), KVStore(retain_bytes=1 << 30)),
            ShardExecutor(load_shard(source, Shard(n // 2, n - 1, n), progress=False), KVStore(retain_bytes=1 << 30)))


def reference(model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32).eval()


def reference_greedy(model: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' own float32 greedy decode of the file, every token leading clearly."""
    ids = torch.tensor([prompt])
    out = reference(model).generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                                    eos_token_id=None, pad_token_id=0, output_scores=True,
                                    return_dict_in_generate=True)
    assert_clear_lead(torch.stack(out.scores)[:, 0])  # (steps, vocab)
    return out.sequences[0, len(prompt):].tolist()


def greedy(pair, session: str, ids: list[int], steps: int, pos: int = 0, reuse: str = "",
           chunk: int = 0) -> list[int]:
    """Greedy tokens of ``session`` through both hops: ``ids[pos:]`` first (in slices of
    ``chunk`` tokens, if given), then one token a step."""
    head, tail = pair
    mid = head.w.shard.end
    out: list[int] = []
    pending = ids[pos:]
    while len(out) < steps:
        size = chunk or len(pending)
        for at in range(0, len(pending), size):
            x = torch.tensor([pending[at:at + size]])
            hidden = head.run(session, 0, mid, x, pos, reuse=reuse).hidden
            result = tail.run(session, mid + 1, tail.w.shard.end, hidden, pos, reuse=reuse)
            pos, reuse = pos + x.shape[1], ""
        out.append(int(result.logits.argmax()))
        pending = [out[-1]]
    return out


def windows(ex: ShardExecutor, session: str) -> list[WindowLayer]:
    """The sliding-window layers of ``session``'s cache over the hop's layers."""
    layers = ex.kv.get(session).cache.layers
    return [layers[i] for i in range(ex.w.shard.start, ex.w.shard.end + 1) if isinstance(layers[i], WindowLayer)]


def test_chunked_prefill_gives_one_forward_logits_and_keeps_only_the_window(model):
    """30 tokens in slices of 5: the head's hidden states and the tail's logits are those of
    one transformers forward; then a long session keeps each sliding layer under its bound."""
    pair, ids = hops(model), torch.tensor([PROMPT[:30]])
    with torch.no_grad():
        ref = reference(model)(ids, output_hidden_states=True)
    head, tail = pair
    mid = head.w.shard.end
    assert "sliding_attention" in tail.layer_types[mid + 1:] and "full_attention" in tail.layer_types[mid + 1:]
    assert {"sliding_attention", "full_attention"} <= set(head.layer_types[:mid + 1])
    # kept for reuse, but never batched: a batch group's rows have no window (each decodes alone)
    assert head.reusable(0, mid) and not head.batchable(0, mid)
    for pos in range(0, 30, 5):
        hidden = head.run("s", 0, mid, ids[:, pos:pos + 5], pos).hidden  # (1, 5, hidden)
        torch.testing.assert_close(hidden[0], ref.hidden_states[mid + 1][0, pos:pos + 5], atol=1e-4, rtol=0)
        logits = tail.run("s", mid + 1, tail.w.shard.end, hidden, pos).logits
        torch.testing.assert_close(logits, ref.logits[0, pos + 4], atol=1e-4, rtol=0)
    greedy(pair, "s", PROMPT[:30] + [int(logits.argmax())], 110, pos=30)  # 140 positions, past BOUND
    for ex in pair:
        layers = windows(ex, "s")
        assert layers and all(layer.get_seq_length() == 140 for layer in layers)
        for layer in layers:
            per_position = layer.keys[:, :, :1].numel() * layer.keys.element_size() * 2
            assert layer.keys.shape[-2] <= BOUND and layer.first > 0  # it shifted: the oldest are gone
            assert layer.nbytes() <= BOUND * per_position


def test_split_decode_gives_transformers_tokens_in_slices(model):
    expected = reference_greedy(model, PROMPT, 24)
    assert greedy(hops(model), "s", PROMPT, 24, chunk=7) == expected


def test_kept_kv_serves_a_later_request_whole_and_cut_back(model):
    """Turn 2 continues all of turn 1's kept KV (moved); a third request shares all but the
    last few tokens of it (a copy, the entry staying). Both give a cold run's tokens."""
    pair = hops(model)
    first = greedy(pair, "t1", PROMPT, 12)
    for ex in pair:
        ex.retain("t1")
    held = PROMPT + first[:-1]  # 51 positions: the last token was never fed back
    for ex in pair:
        kept = ex.kv.retained.peek("t1").cache.layers
        assert all(kept[i].keys.shape[-2] == min(len(held), SLIDING_WINDOW - 1 + SLACK) == kept[i].nbytes() // (
            2 * kept[i].keys[:, :, :1].numel() * 4) for i in range(ex.w.shard.start, ex.w.shard.end + 1)
            if isinstance(kept[i], WindowLayer))  # kept: the window and the slack, no room to spare
    turn2 = held + [40, 41, 42]
    assert greedy(pair, "t2", turn2, 10, pos=len(held), reuse="t1") == reference_greedy(model, turn2, 10)
    assert all("t1" not in ex.kv.retained for ex in pair)  # moved, not copied
    for ex in pair:
        ex.retain("t2")
    cut = len(turn2) - 4  # a follow-up that tokenized the end of turn 2 differently
    turn3 = turn2[:cut] + [90, 91, 92, 93, 94]
    assert greedy(pair, "t3", turn3, 10, pos=cut, reuse="t2") == reference_greedy(model, turn3, 10)
    assert all("t2" in ex.kv.retained for ex in pair)  # copied: the longer KV stays kept
    assert [ex.kv.retained.stats["hits"] for ex in pair] == [2, 2]


def test_a_full_layer_alone_batches_and_takes_riding_prompts_as_the_model_attends(model):
    """A hop of one full-attention layer batches decode steps (no window on it), so prompts ride
    its decode passes: each part attends as the model does alone (Gemma 2 caps its scores, its
    eager path; SDPA cannot), and gets what it gets alone."""
    source = resolve(str(model))
    config = load_config(source, None)
    n = config.num_hidden_layers
    full = next(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
    mixed, alone = (ShardExecutor(load_shard(source, Shard(full, full, n), progress=False), KVStore())
                    for _ in range(2))
    assert mixed.batchable(full, full)
    torch.manual_seed(0)
    hidden = torch.randn(1, 12, mixed.hidden_size)
    for ex in (mixed, alone):
        ex.run("s", full, full, hidden[:, :5], 0)
    step, chunk = Step("s", full, full, hidden[:, 5:6], 5), Step("p", full, full, hidden[:, 6:], 0)
    got = mixed.run_mixed([step], [Chunk(chunk)])
    expected = alone.run_batch([step]) + [alone.run("p", full, full, chunk.inputs, 0)]
    for g, e in zip(got, expected):
        assert torch.allclose(g.hidden, e.hidden, rtol=1e-5, atol=1e-5)


def test_a_cut_past_the_slack_misses_and_a_prefill_from_scratch_gives_the_same_tokens(model):
    """A sliding layer keeps window - 1 + SLACK positions: a request cutting back further
    misses (the head then prefills in full, as after any miss: a failover's re-prefill),
    and the prefill from position 0, in slices, gives the tokens of a cold run."""
    pair = hops(model)
    long_prompt = (PROMPT * 4)[:150]
    first = greedy(pair, "t1", long_prompt, 4, chunk=32)
    for ex in pair:
        ex.retain("t1")
    held = len(long_prompt) + 3
    head, tail = pair
    mid = head.w.shard.end
    with pytest.raises(CacheMissError):  # positions held - SLACK - 1 - window + 1 .. are gone
        head.run("t2", 0, mid, torch.tensor([[5]]), held - SLACK - 1, reuse="t1")
    with pytest.raises(CacheMissError):
        tail.run("t2", mid + 1, tail.w.shard.end, torch.zeros((1, 1, tail.hidden_size)), held - SLACK - 1,
                 reuse="t1")
    assert [ex.kv.retained.stats["misses"] for ex in pair] == [1, 1] and all("t1" in ex.kv.retained for ex in pair)
    ids = long_prompt + first[:-1]
    turn2 = ids[:held - SLACK] + [70, 71, 72]
    expected = reference_greedy(model, turn2, 8)
    assert greedy(pair, "t2", turn2, 8, pos=held - SLACK, reuse="t1") == expected  # at the slack's edge: a hit
    assert greedy(pair, "t3", turn2, 8, chunk=16) == expected  # from scratch, in slices
    assert greedy(pair, "t3", turn2 + expected[:4], 4, chunk=13) == expected[4:]  # the same session re-prefilled
