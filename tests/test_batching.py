"""Decode steps of concurrent sessions batched into one forward pass give the same tokens."""
from __future__ import annotations

import os

import pytest
import torch

from fabric.compute.cache import GrowingLayer
from fabric.compute.executor import CacheMissError, Chunk, ShardExecutor, Step
from fabric.compute.kv import RESERVE_POSITIONS, KVStore
from fabric.compute.models import load_shard, resolve
from fabric.compute.rows import RowGroup
from fabric.wire.shard import Shard
from tests.tiny_models import FAMILIES, assert_clear_lead, reference_greedy

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34]]


def greedy_alone(ex: ShardExecutor, session: str, prompt: list[int], steps: int) -> list[int]:
    """Float32 greedy tokens of one session alone; a batch computes them in another order,
    so each must lead clearly (tests/tiny_models.py)."""
    result = ex.run(session, 0, 5, torch.tensor([prompt]), 0)
    rows, pos = [result.logits], len(prompt)  # (vocab,) each
    for _ in range(steps):
        result = ex.run(session, 0, 5, torch.tensor([[int(rows[-1].argmax())]]), pos)
        rows.append(result.logits)
        pos += 1
    assert_clear_lead(torch.stack(rows))  # (steps + 1, vocab)
    return [int(row.argmax()) for row in rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_unbatched(tiny_models, family):
    ex = ShardExecutor(load_shard(resolve(str(tiny_models(family))), Shard(0, 5, 6), progress=False), KVStore())
    expected = [greedy_alone(ex, f"alone{i}", p, 12) for i, p in enumerate(PROMPTS)]
    tokens, pos = [], []
    for i, prompt in enumerate(PROMPTS):  # different lengths: the batch pads and masks
        tokens.append([int(ex.run(f"b{i}", 0, 5, torch.tensor([prompt]), 0).logits.argmax())])
        pos.append(len(prompt))
    for _ in range(12):
        steps = [Step(f"b{i}", 0, 5, torch.tensor([[tokens[i][-1]]]), pos[i]) for i in range(len(PROMPTS))]
        for i, result in enumerate(ex.run_batch(steps)):
            tokens[i].append(int(result.logits.argmax()))
            pos[i] += 1
    assert tokens == expected


class Sessions:
    """Sessions of PROMPTS on one executor, stepped greedily in any line-up: a batch, or a
    lone step (which runs on the session's row where it has one)."""

    def __init__(self, ex: ShardExecutor):
        self.ex, self.tokens, self.pos = ex, [[] for _ in PROMPTS], [0] * len(PROMPTS)

    def prefill(self, i: int) -> None:
        self.tokens[i] = [int(self.ex.run(f"s{i}", 0, 5, torch.tensor([PROMPTS[i]]), 0).logits.argmax())]
        self.pos[i] = len(PROMPTS[i])

    def step(self, members: list[int]) -> None:
        ex, tokens, pos = self.ex, self.tokens, self.pos
        steps = [Step(f"s{i}", 0, 5, torch.tensor([[tokens[i][-1]]]), pos[i]) for i in members]
        if len(steps) == 1:
            results = [ex.run(steps[0].session, 0, 5, steps[0].inputs, steps[0].pos)]
        else:
            results = ex.run_batch(steps)
        for i, result in zip(members, results):
            tokens[i].append(int(result.logits.argmax()))
            pos[i] += 1

    def finish(self, steps: int) -> None:
        while any(len(t) < steps + 1 for t in self.tokens):
            self.step([i for i in range(len(PROMPTS)) if len(self.tokens[i]) < steps + 1])


def test_batch_groups_keep_every_session_exact_as_members_come_and_go(tiny_models):
    """Sessions that decode together keep their KV as rows of one group, where each batched
    step reads and appends to it in place: while the line-up stays nothing moves (the
    group's buffers stay where they are and no session has a cache of its own). A session
    that ends frees its row and the others stay; a newcomer joins a free row. Whatever the
    order, every session's tokens are those it gets alone."""
    ex = ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(0, 5, 6), progress=False), KVStore())
    expected = [greedy_alone(ex, f"alone{i}", p, 14) for i, p in enumerate(PROMPTS)]
    run = Sessions(ex)
    for i in range(3):
        run.prefill(i)
    run.step([0, 1, 2])
    group, buffers = ex.group, [t.data_ptr() for t in (*ex.group.keys.values(), *ex.group.values.values())]
    for members in [[0, 1, 2], [0, 1, 2], [1, 2], [0], [0, 1, 2], [2, 0, 1], [2, 0, 1]]:
        run.step(members)
    assert ex.group is group and [t.data_ptr() for t in (*group.keys.values(), *group.values.values())] == buffers
    assert all(ex.kv.get(f"s{i}").cache is None and ex.kv.get(f"s{i}").group is group for i in range(3))
    ex.kv.drop("s1")  # closed while a row of the group: its row is freed, the others stay
    ex.free_row("s1")
    assert group.members() == ["s0", "s2"] and ex.kv.get("s0").group is group
    run.prefill(1)  # then it starts over with a fresh prefill
    run.prefill(3)  # a newcomer joins
    run.finish(14)
    assert run.tokens == expected
    assert sum(ex.kv.get(f"s{i}").nbytes() for i in range(4)) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_batch_spread_over_the_group_runs_only_its_own_rows(tiny_models, family, monkeypatch):
    """Streams that run as two groups (a pipeline over the nodes) hold rows spread over the
    batch group. A pass runs every row from its batch's first to its last, so their rows are
    brought side by side first: each pass then runs only its own rows, rows move once, not at
    every pass, and every session's tokens stay those it gets alone."""
    ex = ShardExecutor(load_shard(resolve(str(tiny_models(family))), Shard(0, 5, 6), progress=False), KVStore())
    expected = [greedy_alone(ex, f"alone{i}", p, 14) for i, p in enumerate(PROMPTS)]
    run = Sessions(ex)
    for i in range(4):
        run.prefill(i)
    run.step([0, 1, 2, 3])  # rows 0..3, in that order
    widths, swaps, inputs, swap = [], [], ex._row_inputs, RowGroup.swap
    monkeypatch.setattr(ex, "_row_inputs", lambda steps, rows, lo, hi: widths.append(hi - lo) or inputs(steps, rows, lo, hi))
    monkeypatch.setattr(RowGroup, "swap", lambda group, a, b: swaps.append((a, b)) or swap(group, a, b))
    for _ in range(5):
        run.step([0, 2])
        run.step([3, 1])
    assert widths == [2] * 10
    assert len(swaps) == 1
    run.finish(14)
    assert run.tokens == expected


def test_rows_packed_and_grown_under_churn_stay_exact(tiny_models, monkeypatch):
    """Buffers with hardly any room to spare are rebuilt every few steps: more sessions
    than rows, rows that skip steps (holes in their columns) and get packed once the one
    dense row has gone, a lone chunk of several positions that takes a session out of its
    row, and its return."""
    monkeypatch.setattr("fabric.compute.kv.GROW_MIN", 1)
    monkeypatch.setattr("fabric.compute.rows.MIN_ROWS", 1)
    monkeypatch.setattr("fabric.compute.kv.LAZY_FROM", 0)  # every buffer mapped on first touch, as a real model's
    monkeypatch.setattr("fabric.compute.kv.RESERVE_POSITIONS", 0)  # ... and grown as often as the heap's
    ex = ShardExecutor(load_shard(resolve(str(tiny_models("qwen3"))), Shard(0, 5, 6), progress=False), KVStore())
    expected = [greedy_alone(ex, f"alone{i}", p, 16) for i, p in enumerate(PROMPTS)]
    run = Sessions(ex)
    for i in range(4):
        run.prefill(i)
    for members in [[0, 1], [0, 1, 2, 3], [3], [3], [0, 3]] + [[3]] * 24 + [[1, 2, 3], [0, 1, 2, 3]]:
        run.step(members)
    assert len(ex.group.sessions) == 4
    ex.kv.drop("s3")  # the one row without holes goes: the rest are mostly holes, packed when next full
    ex.free_row("s3")
    run.prefill(3)
    expected[3] = greedy_alone(ex, "again", PROMPTS[3], 16)
    # two positions at once: the session leaves its row for a cache of its own, then rejoins
    before = run.tokens[2]
    assert before == expected[2][:len(before)]
    chunk = ex.run("s2", 0, 5, torch.tensor([[before[-1], 7]]), run.pos[2])
    assert ex.kv.get("s2").group is None and ex.group.row("s2") is None
    run.tokens[2], run.pos[2] = before + [int(chunk.logits.argmax())], run.pos[2] + 2
    run.finish(16)
    assert run.tokens[:2] + run.tokens[3:] == expected[:2] + expected[3:]
    assert run.tokens[2] == before + greedy_alone(ex, "after", PROMPTS[2] + before + [7], 16 - len(before))
    assert ex.kv.get("s2").group is ex.group


def test_a_group_keeps_resident_only_the_columns_its_sessions_fill():
    """A group's buffers have room for rows and columns nobody fills yet (four rows for one
    session, half as many columns again); only what its sessions write becomes resident, a
    rebuild copies each row's own positions, so its rows past them stay zero (they are read,
    masked, by a pass), and a row freed gives its pages back."""
    group, layers = RowGroup(0, 29), 30
    keys = torch.randn(1, 3, 3000, 64).to(torch.bfloat16)  # SmolLM2's shape: 69 MB a row of 3,000 positions
    values = keys + 1
    before = _resident()
    group.join("a", {i: (keys, values) for i in range(layers)})
    buffer = group.kv.numel() * group.kv.element_size()
    assert group.kv.shape[2] == 4 and group.columns == 4500
    assert _resident() - before < buffer / 3  # one row of four, 2/3 of its columns (new_zeros: all of it)
    group.lengths[0] = group.columns  # full: the next step grows the buffers
    group.step_cache(0, 1)
    assert group.columns > 4500 and torch.equal(group.keys[7][0, :, :3000], keys[0])
    assert torch.equal(group.values[29][0, :, :3000], values[0])
    assert not group.kv[:, :, 1:].any() and not group.kv[:, :, 0, :, :, 4500:].any()
    held = _resident()
    group.free(0)  # its pages go back to the OS
    assert held - _resident() > 0.9 * 3000 * group.column_bytes
    assert group.row_bytes(0) == 0


def test_a_sessions_own_cache_reserves_far_ahead_and_counts_only_its_positions():
    """A session's own cache on a CPU lies in memory mapped as it fills: a prompt's buffers
    reserve RESERVE_POSITIONS, so the steps after it neither copy nor grow them, and its bytes
    are its positions'; kept for reuse, it is cut to exactly them on the heap."""
    layer, keys = GrowingLayer(), torch.randn(1, 8, 300, 64).to(torch.bfloat16)
    layer.update(keys[:, :, :100], keys[:, :, :100] + 1)  # a prompt
    buffer, per_position = layer._keys.data_ptr(), 2 * 8 * 64 * 2
    assert layer.mapped and layer._keys.shape[-2] == RESERVE_POSITIONS and layer.nbytes() == 100 * per_position
    for pos in range(100, 300):
        layer.update(keys[:, :, pos:pos + 1], keys[:, :, pos:pos + 1] + 1)
    assert layer._keys.data_ptr() == buffer and torch.equal(layer.keys, keys) and torch.equal(layer.values, keys + 1)
    assert layer.nbytes() == 300 * per_position
    layer.trim()
    assert not layer.mapped and layer._keys.shape[-2] == 300 and layer.nbytes() == 300 * per_position
    assert torch.equal(layer.keys, keys)


def _resident() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_prefilled_together_then_decoded_together_equal_each_alone(tiny_models, family):
    """Whole prompts of different lengths in one padded forward pass, on both hops of a
    split (token ids into the head, hidden states into the tail), then decode steps as a
    batch group: every session's tokens are those of a single-process run."""
    source = resolve(str(tiny_models(family)))
    head = ShardExecutor(load_shard(source, Shard(0, 2, 6), progress=False), KVStore())
    tail = ShardExecutor(load_shard(source, Shard(3, 5, 6), progress=False), KVStore())
    names = [f"p{i}" for i in range(len(PROMPTS))]
    hidden = head.run_prefills([Step(n, 0, 2, torch.tensor([p]), 0) for n, p in zip(names, PROMPTS)])
    assert [h.hidden.shape[1] for h in hidden] == [len(p) for p in PROMPTS]  # the padding stays behind
    results = tail.run_prefills([Step(n, 3, 5, h.hidden, 0) for n, h in zip(names, hidden)])
    tokens = [[int(r.logits.argmax())] for r in results]
    pos = [len(p) for p in PROMPTS]
    for _ in range(8):
        mid = head.run_batch([Step(n, 0, 2, torch.tensor([[t[-1]]]), p) for n, t, p in zip(names, tokens, pos)])
        out = tail.run_batch([Step(n, 3, 5, m.hidden, p) for n, m, p in zip(names, mid, pos)])
        for i, r in enumerate(out):
            tokens[i].append(int(r.logits.argmax()))
            pos[i] += 1
    for got, prompt in zip(tokens, PROMPTS):
        expected = reference_greedy(tiny_models(family), prompt, 9)  # stops at an end-of-sequence token
        assert got[:len(expected)] == expected and len(expected) >= 3


def test_batch_reports_cache_misses_per_session(tiny_models):
    ex = ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(0, 5, 6), progress=False), KVStore())
    ex.run("a", 0, 5, torch.tensor([PROMPTS[0]]), 0)
    results = ex.run_batch([Step("a", 0, 5, torch.tensor([[1]]), 3), Step("ghost", 0, 5, torch.tensor([[1]]), 9)])
    assert results[0].logits is not None and results[1].have == 0


def test_concurrent_streams_are_batched_and_unchanged(thread_cluster, tiny_models):
    model = tiny_models("qwen2")
    head = thread_cluster.add_node(model, 0, 2, 6, "head")
    tail = thread_cluster.add_node(model, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model.name, 2)
    prompts = ["hello world", "the quick brown fox", "how are you today?", "meshnet splits a model"]
    outputs = thread_cluster.stream_all(model.name, prompts, 40)
    for i, prompt in enumerate(prompts):
        ids = prompt_ids_for(model, prompt)
        assert outputs[i] == reference_greedy(model, ids, 40), prompt
    assert head.counters["batched_hops"] + tail.counters["batched_hops"] > 0


def prompt_ids_for(model, text: str) -> list[int]:
    from fabric.compute.models import load_tokenizer

    tok = load_tokenizer(resolve(str(model)))
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_in_chunks_riding_decode_passes_equals_each_alone(tiny_models, family):
    """A long prompt's chunks run inside the decode batch's forward pass (run_mixed), on both
    hops of a split: the streams' tokens and the prompt's are those of single-process runs,
    and the prompt then decodes in the batch with them."""
    source = resolve(str(tiny_models(family)))
    head = ShardExecutor(load_shard(source, Shard(0, 2, 6), progress=False), KVStore())
    tail = ShardExecutor(load_shard(source, Shard(3, 5, 6), progress=False), KVStore())
    streams, prompt = PROMPTS[:3], list(range(40, 63))
    names = [f"d{i}" for i in range(len(streams))]
    hidden = head.run_prefills([Step(n, 0, 2, torch.tensor([p]), 0) for n, p in zip(names, streams)])
    results = tail.run_prefills([Step(n, 3, 5, h.hidden, 0) for n, h in zip(names, hidden)])
    tokens, pos = [[int(r.logits.argmax())] for r in results], [len(p) for p in streams]

    def decode_steps(hop, inputs, start, end):
        return [Step(n, start, end, x, p) for n, x, p in zip(names, inputs, pos)]

    for at in range(0, len(prompt), 5):  # chunks of 5 (the last of 3), each riding a decode pass
        chunk, last = prompt[at:at + 5], at + 5 >= len(prompt)
        ids = [torch.tensor([[t[-1]]]) for t in tokens]
        mid = head.run_mixed(decode_steps(head, ids, 0, 2), [Chunk(Step("p", 0, 2, torch.tensor([chunk]), at), last)])
        out = tail.run_mixed(decode_steps(tail, [m.hidden for m in mid[:-1]], 3, 5),
                             [Chunk(Step("p", 3, 5, mid[-1].hidden, at), last)])
        for i, r in enumerate(out[:-1]):
            tokens[i].append(int(r.logits.argmax()))
            pos[i] += 1
    assert out[-1].logits is not None and head.kv.get("p").group is None
    names, pos, tokens = names + ["p"], pos + [len(prompt)], tokens + [[int(out[-1].logits.argmax())]]
    for _ in range(4):  # the prompt joins the streams' batch
        mid = head.run_batch(decode_steps(head, [torch.tensor([[t[-1]]]) for t in tokens], 0, 2))
        out = tail.run_batch(decode_steps(tail, [m.hidden for m in mid], 3, 5))
        for i, r in enumerate(out):
            tokens[i].append(int(r.logits.argmax()))
            pos[i] += 1
    assert head.kv.get("p").group is head.group
    for got, ids in zip(tokens, streams + [prompt]):
        expected = reference_greedy(tiny_models(family), ids, len(got))  # stops at an end-of-sequence token
        assert got[:len(expected)] == expected and len(expected) >= 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_mixed_pass_on_the_tail_reads_its_lm_head_once_for_every_row_it_owes(tiny_models, family):
    """Decode steps and two prompts' last chunks in one pass on the tail: one lm_head call gives
    the logits of every one of them, each the bits it gets alone (the default mode's kernels are
    batch-invariant), and a chunk that owes no logits gets none."""
    source = resolve(str(tiny_models(family)))
    ours, alone = (ShardExecutor(load_shard(source, Shard(0, 5, 6), progress=False, quant="int8"), KVStore())
                   for _ in range(2))
    names, chunks = ["d0", "d1"], {"p": list(range(40, 51)), "q": list(range(60, 67)), "r": [70, 71, 72]}
    for ex in (ours, alone):
        ex.run_prefills([Step(n, 0, 5, torch.tensor([p]), 0) for n, p in zip(names, PROMPTS)])
    calls, head = [], ours.w.lm_head
    ours.w.lm_head = lambda x: calls.append(x.shape[0]) or head(x)
    steps = [Step(n, 0, 5, torch.tensor([[3 + i]]), len(PROMPTS[i])) for i, n in enumerate(names)]
    got = ours.run_mixed(steps, [Chunk(Step(n, 0, 5, torch.tensor([ids]), 0), n != "r") for n, ids in chunks.items()])
    assert calls == [4]  # two steps' rows and the two chunks' last positions
    expected = alone.run_batch(steps) + [alone.run(n, 0, 5, torch.tensor([ids]), 0) for n, ids in chunks.items()]
    for g, e in zip(got[:4], expected):
        assert torch.equal(g.logits, e.logits)
    assert got[4].logits is None and got[4].hidden is None


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_a_prompts_last_token_after_kept_kv_joins_the_decode_rows(tiny_models, family):
    """A request that continues kept KV all but its last token (a chat's next turn, a prompt asked
    again) is one decode step once its session holds that KV: beside decode steps it joins the
    batch group's rows, not a chunk's own cache beside them (8 such chunks made a pass 4x a
    decode pass of 4 rows). Its logits are the bits it gets alone, whether it takes a copy of the
    kept prefix or the kept KV itself."""
    source = resolve(str(tiny_models(family)))
    ours, alone = (ShardExecutor(load_shard(source, Shard(0, 5, 6), progress=False, quant="int8"),
                                 KVStore(retain_bytes=1 << 30)) for _ in range(2))
    names, kept = ["d0", "d1"], PROMPTS[1] + [40, 41, 42]
    for ex in (ours, alone):
        ex.run_prefills([Step(n, 0, 5, torch.tensor([p]), 0) for n, p in zip(names, PROMPTS)])
        for old in ("old", "older"):
            ex.run(old, 0, 5, torch.tensor([kept]), 0)
            ex.retain(old)
    steps = [Step(n, 0, 5, torch.tensor([[3 + i]]), len(PROMPTS[i])) for i, n in enumerate(names)]
    chunks = [Chunk(Step("copy", 0, 5, torch.tensor([[kept[6]]]), 6), reuse="old"),  # a copy of its first 6
              Chunk(Step("whole", 0, 5, torch.tensor([[50]]), len(kept)), reuse="older")]  # the kept KV itself
    got = ours.run_mixed(steps, chunks)
    assert all(ours.kv.get(n).group is ours.group for n in names + ["copy", "whole"])
    expected = alone.run_batch(steps) + [alone.run(c.step.session, 0, 5, c.step.inputs, c.step.pos, reuse=c.reuse)
                                         for c in chunks]
    assert alone.kv.get("copy").group is None  # alone: a chunk on a cache of its own
    for g, e in zip(got, expected):
        assert torch.equal(g.logits, e.logits)


def test_short_prompts_ride_together_and_a_miss_costs_only_its_own_chunk(tiny_models):
    """Two whole prompts ride in one decode pass beside a chunk whose kept KV is gone: the
    streams and the prompts get their single-process tokens, the lost chunk a cache miss."""
    model = tiny_models("qwen3_moe")
    ex = ShardExecutor(load_shard(resolve(str(model)), Shard(0, 5, 6), progress=False), KVStore())
    run = Sessions(ex)
    for i in range(2):
        run.prefill(i)
    steps = [Step(f"s{i}", 0, 5, torch.tensor([[run.tokens[i][-1]]]), run.pos[i]) for i in range(2)]
    chunks = [Chunk(Step("s2", 0, 5, torch.tensor([PROMPTS[2]]), 0)), Chunk(Step("gone", 0, 5, torch.tensor([[7]]), 9),
                                                                          reuse="never-kept"),
              Chunk(Step("s3", 0, 5, torch.tensor([PROMPTS[3]]), 0))]
    results = ex.run_mixed(steps, chunks)
    assert isinstance(results[3], CacheMissError) and "gone" not in ex.kv
    for i, result in zip([0, 1, 2, 3], results[:3] + results[4:]):
        if i < 2:
            run.tokens[i].append(int(result.logits.argmax()))
            run.pos[i] += 1
        else:
            run.tokens[i], run.pos[i] = [int(result.logits.argmax())], len(PROMPTS[i])
    run.finish(8)
    for got, prompt in zip(run.tokens, PROMPTS):
        expected = reference_greedy(model, prompt, 9)  # stops at an end-of-sequence token
        assert got[:len(expected)] == expected and len(expected) >= 3


def test_chunks_with_no_decode_step_share_one_pass(tiny_models):
    """With no decode step to ride, short chunks still run as one pass: what follows a kept
    prefix and a fresh prompt; then both decode in the batch group, as a single process would."""
    model = tiny_models("mistral")
    ex = ShardExecutor(load_shard(resolve(str(model)), Shard(0, 5, 6), progress=False), KVStore(retain_bytes=1 << 30))
    kept = PROMPTS[1] + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    ex.run("old", 0, 5, torch.tensor([kept]), 0)
    ex.retain("old")
    turn = kept + [53, 54, 55]
    results = ex.run_mixed([], [Chunk(Step("s0", 0, 5, torch.tensor([turn[len(kept):]]), len(kept)), reuse="old"),
                                Chunk(Step("s1", 0, 5, torch.tensor([PROMPTS[0]]), 0))])
    assert ex.kv.retained.stats["hits"] == 1
    tokens, pos = [[int(r.logits.argmax())] for r in results], [len(turn), len(PROMPTS[0])]
    for _ in range(6):
        out = ex.run_batch([Step(f"s{i}", 0, 5, torch.tensor([[tokens[i][-1]]]), pos[i]) for i in range(2)])
        for i, r in enumerate(out):
            tokens[i].append(int(r.logits.argmax()))
            pos[i] += 1
    for got, prompt in zip(tokens, [turn, PROMPTS[0]]):
        expected = reference_greedy(model, prompt, 7)  # stops at an end-of-sequence token
        assert got[:len(expected)] == expected and len(expected) >= 3
