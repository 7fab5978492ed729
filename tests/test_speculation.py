"""Speculation across the pipeline, below the sockets: drafts by prompt lookup, how a session
sizes and pauses them, the tail's verification (greedy and the sampling acceptance rule,
checked statistically), and a hop cutting rejected drafts off a session's KV in place.
tests/test_speculation_cluster.py runs it on real nodes."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from fabric.compute.executor import CacheMissError, ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.compute.sampling import sample
from fabric.node.asks import SessionAsks
from fabric.node.speculation import Lookup, Speculation, SpeculationConfig, best_drafts, tokens_per_trip
from fabric.wire import protocol as p
from fabric.wire.shard import Shard

HOP = p.Hop("t", "tcp://127.0.0.1:1", 3, 5)


# --------------------------------------------------------------------------- drafts


def test_lookup_proposes_what_followed_the_longest_earlier_ngram():
    history = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    # "5 6 7" occurred at the start, followed by 8 1 6; "6 7" last followed by 9: the 3-gram wins
    assert Lookup().propose(history, 3) == [8, 1, 6]
    assert Lookup().propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert Lookup().propose([4, 9, 4], 2) == [9, 4]  # a loop continues as a loop (period 2)


def test_lookup_grows_with_the_history_and_takes_the_latest_occurrence():
    lookup, history = Lookup(), [1, 2, 3]
    assert lookup.propose(history, 2) == []
    history += [9, 1, 2, 3, 7, 1, 2, 3]
    assert lookup.propose(history, 2) == [7, 1]  # the latest "1 2 3" was followed by 7
    assert lookup.propose(history, 0) == []


def test_a_walk_without_the_rule_grows_after_full_steps_and_shrinks_after_a_rejection():
    spec = Speculation(SpeculationConfig(max_drafts=5, first_drafts=2, adaptive=False))
    history = [1, 2, 3, 4] * 4
    assert spec.drafts(history, room=10) == [1, 2]
    spec.answered(2, 2, 0.1)
    assert spec.drafts(history, room=10) == [1, 2, 3]  # all kept: one more
    assert spec.drafts(history, room=1) == [1]  # never past what the request may still take
    spec.answered(3, 1, 0.1)
    assert spec.size == 2  # a rejection: what held, and one
    for _ in range(6):
        spec.answered(2, 0, 0.1)
    assert spec.drafts(history, 10) == [1]  # drafts whatever happens
    assert (spec.trips, spec.drafted, spec.kept) == (8, 17, 3)


def test_k_follows_the_yield_against_the_cost_of_a_draft():
    """The rule: the k of most tokens per unit of trip, E(k) / (1 + k c). A draft pays only
    where its chance of being kept beats its cost; a slower trip (a larger share of waiting)
    takes more drafts; better drafts, more."""
    assert tokens_per_trip(0.5, 0.5, 0) == 1 and tokens_per_trip(0.5, 0.5, 2) == 1.75
    assert tokens_per_trip(0.2, 0.9, 3) == pytest.approx(1 + 0.2 * 2.71)
    assert best_drafts(0.3, 0.3, 0.35, 6) == 0 and best_drafts(0.4, 0.4, 0.35, 6) >= 1  # a must beat c
    fast, slow = best_drafts(0.6, 0.6, 0.1, 8), best_drafts(0.6, 0.6, 0.02, 8)
    assert 1 <= fast < slow
    assert best_drafts(0.9, 0.9, 0.1, 8) > fast
    assert best_drafts(0.3, 0.9, 0.05, 8) > best_drafts(0.3, 0.3, 0.05, 8)  # runs of kept drafts: longer steps
    assert best_drafts(1.0, 1.0, 0.0, 6) == 6 and best_drafts(0.0, 0.0, 0.0, 6) == 0  # ties: the fewest


def test_a_session_times_its_route_and_stops_drafting_where_it_does_not_pay():
    """Timed steps give the cost: plain trips of 100 ms, verifications 10 ms longer per draft
    (c = 0.1) on a route the head has alone. Drafts that hold as these did pay there (k = 2);
    with 2 streams on the same hops a draft costs twice that and k falls. A cost measured
    below ``min_cost`` counts as that while the head heads more than one request (a shared
    pass times a draft's positions as noise); one stream's own timing counts as measured. After
    drafts that seldom hold, none are sent, until a probe (one draft after a 3-gram match) once
    ``pause_steps`` steps passed without any; a probe that fails doubles the wait. A session
    that shares its head with other requests never probes."""
    config = SpeculationConfig(max_drafts=6, pause_steps=3, prior_accept=0.5, smoothing=0.5)
    spec = Speculation(config)
    history = [1, 2, 3, 4] * 4  # ends with a 3-gram seen before
    assert spec.drafts(history, 10) == [1, 2, 3]  # nothing timed: the least cost, 0.05
    spec.answered(0, 0, 0.100)  # a plain trip: 100 ms
    spec.matched = 3
    spec.answered(4, 2, 0.140)  # 4 drafts, 2 kept: 40 ms more
    assert spec.cost == pytest.approx(0.1)
    assert (spec.yields.first[2], spec.yields.then[2]) == (0.75, 0.375)  # kept: the first, one more, then a miss
    alone = best_drafts(spec.yields.first[2], spec.yields.then[2], spec.cost, 6)
    assert alone == 2 and spec.drafts(history, 10) == [1, 2]
    spec.streams = 2
    assert len(spec.drafts(history, 10)) == 1
    spec.streams = 1
    for _ in range(12):
        spec.answered(2, 0, 0.102)  # drafts that never hold, and cost 1 ms each
    assert spec.cost == pytest.approx(0.01, rel=0.01)  # one stream: its own timing, under min_cost
    spec.streams = 2
    assert spec.cost == 2 * config.min_cost  # two: at least min_cost each
    spec.streams = 1
    assert [spec.drafts(history, 10) for _ in range(3)] == [[], [], [1]]  # 3 steps without, then a probe
    spec.answered(1, 0, 0.101)  # it fails: twice as long before the next
    assert [spec.drafts(history, 10) for _ in range(6)] == [[]] * 5 + [[1]]
    assert spec.drafts([5, 6, 7, 8, 9, 6] * 1, 10) == []  # only a 1-gram match: no probe after it
    spec.streams = 2
    assert [spec.drafts(history, 10) for _ in range(24)] == [[]] * 24  # a shared pass: no probe however long
    spec.streams = 1
    assert spec.drafts(history, 10) == [1]  # alone again: the probe that was due
    spec.stop()
    assert spec.drafts(history, 10) == []


def test_a_request_in_a_crowd_starts_from_what_a_draft_cost_its_head_s_others():
    """In a pass shared by 8 streams one draft made the pass 36% longer (9 rows of float32
    where 8 ran). A new request in the crowd counts that before it has drafted itself, and so
    sends none after a 3-gram a fresh head would draft on; a request alone keeps its own cost."""
    from fabric.node.speculation import DraftTiming

    config = SpeculationConfig(max_drafts=6, prior_accept=0.5, smoothing=0.5)
    history = [1, 2, 3, 4] * 4
    timing = DraftTiming()
    first = Speculation(config, timing=timing, streams=8)
    assert first.drafts(history, 10) == [1]  # untimed: the least cost, 0.05 a stream
    first.answered(0, 0, 0.100)  # a plain trip of the crowd's pass
    first.matched = 3
    first.answered(1, 0, 0.136)  # one draft: 36 ms more
    assert timing.crowd == pytest.approx(0.36)
    assert Speculation(config, timing=timing, streams=8).drafts(history, 10) == []
    assert Speculation(config, timing=DraftTiming(), streams=8).drafts(history, 10) == [1]  # (a control)
    assert Speculation(config, timing=timing, streams=1).cost == config.min_cost  # alone: its own


def test_a_head_s_requests_start_from_what_its_earlier_requests_found():
    """Sessions of one head learn into its DraftYield, per n-gram length, and a new session starts
    from it: after chat-like requests whose drafts after a 1-gram failed, a new request in a
    crowd does not draft after a 1-gram, and still does after a 3-gram."""
    from fabric.node.speculation import DraftYield

    config = SpeculationConfig(smoothing=0.3)
    shared = DraftYield.prior(config)
    for _ in range(6):
        old = Speculation(config, shared=shared)
        assert old.drafts([9, 5, 7, 5], 10) != []  # "5" seen before: a 1-gram match
        old.answered(3, 0, 0.1)
    assert shared.first[0] < 0.3 and shared.first[2] == config.prior_accept
    new = lambda: Speculation(config, shared=shared, streams=8)  # noqa: E731
    assert new().yields == shared and new().yields is not shared
    assert new().drafts([9, 5, 7, 5], 10) == []
    assert new().drafts([1, 2, 3, 4, 1, 2, 3], 10) == [4]
    assert Speculation(config, streams=8).drafts([9, 5, 7, 5], 10) == [7]  # (a control: from the prior, it would)


# --------------------------------------------------------------------------- the tail's verification


def _forward(drafts: tuple[int, ...], sampling=p.Sampling()) -> p.Forward:
    spec = p.TensorSpec("float32", (1, len(drafts) + 1, 8))
    return p.Forward(session="s", step=1, pos=10, start_layer=3, end_layer=5, route=(), reply_to="tcp://h:1",
                     sampling=sampling, drafts=drafts, tensors=(spec,))


def test_greedy_verification_keeps_the_drafts_the_argmax_agrees_with_and_adds_the_next():
    rows = torch.full((4, 6), -1.0)
    for i, best in enumerate([3, 1, 4, 5]):
        rows[i, best] = 1.0
    asks = SessionAsks()
    assert [t.token for t in asks.verify(_forward((3, 1, 4)), 11, rows)] == [3, 1, 4, 5]  # all kept, and one more
    tokens = asks.verify(_forward((3, 2, 4)), 11, rows)
    assert [(t.token, t.pos) for t in tokens] == [(3, 11), (1, 12)]  # the second draft wrong: the argmax instead
    assert [t.token for t in asks.verify(_forward((0, 1, 4)), 11, rows)] == [3]


def test_sampled_verification_is_the_acceptance_rule_for_a_point_mass_draft():
    """A draft x is kept with probability p(x); the token that replaces a rejected one is
    distributed as p without x, renormalized; and each token is the one a one-token step
    would have sampled with that seed (so a seeded request is reproducible with or without
    speculation). Checked over 4,000 seeds against the exact probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0] * 5])  # (2, vocab): a draft and the next position
    probs = torch.softmax(logits[0], dim=-1)
    draft, n = 1, 4000
    kept, replaced = 0, Counter()
    for seed in range(n):
        sampling = p.Sampling(temperature=1.0, seed=seed)
        tokens = SessionAsks().verify(_forward((draft,), sampling), 11, logits)
        assert tokens[0].token == sample(logits[0], sampling, 11)
        if tokens[0].token == draft:
            kept += 1
            assert len(tokens) == 2 and tokens[1].token == sample(logits[1], sampling, 12)
        else:
            assert len(tokens) == 1
            replaced[tokens[0].token] += 1
    px = float(probs[draft])
    assert abs(kept / n - px) < 4 * math.sqrt(px * (1 - px) / n)
    rest = probs.clone()
    rest[draft] = 0
    rest /= rest.sum()
    chi2 = sum((replaced[t] - (n - kept) * float(rest[t])) ** 2 / ((n - kept) * float(rest[t]))
               for t in range(5) if t != draft)
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom: p = 0.001


def test_forward_drafts_are_bounded_and_only_on_a_decode_step():
    ok = _forward((1, 2))
    ok.validate()
    spec = lambda q: (p.TensorSpec("float32", (1, q, 8)),)  # noqa: E731
    bad = [dict(drafts=tuple(range(p.MAX_DRAFTS + 1)), tensors=spec(p.MAX_DRAFTS + 2)),
           dict(drafts=(1, 2), tensors=spec(4)),  # more positions than drafts and one
           dict(drafts=(1, -2)), dict(pos=0), dict(more=True), dict(reuse="other")]
    for change in bad:
        with pytest.raises(p.ProtocolError):
            dataclasses.replace(ok, **change).validate()
    frames = p.encode(ok, [bytes(3 * 8 * 4)])
    assert p.decode(frames)[0].drafts == (1, 2)
    plain = dataclasses.replace(ok, drafts=(), tensors=spec(1))
    frames = p.encode(plain, [bytes(8 * 4)])
    assert b"drafts" not in bytes(frames[2]) and p.decode(frames)[0].drafts == ()  # a plain step pays no byte


# --------------------------------------------------------------------------- a hop cuts rejected drafts off


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["exact", "default"])
def tail(request, tiny_models):
    source = resolve(str(tiny_models("llama")))
    return ShardExecutor(load_shard(source, Shard(0, 5, 6), dtype=request.param, progress=False), KVStore())


def test_a_step_inside_the_drafted_positions_cuts_them_off_in_place(tail):
    """A verification of 4 drafts, none kept: the next step, at the first draft's position,
    finds the session cut back there (in place: the same buffer), and its logits are those
    of a session that never saw the rejected drafts. A step anywhere else is still a miss."""
    ids = torch.tensor([[1, 17, 40, 99, 23, 61, 8, 250, 77, 31]])  # (1, 10)
    last = 5
    tail.run("plain", 0, last, ids[:, :6], 0)
    tail.run("plain", 0, last, ids[:, 6:7], 6)
    want = tail.run("plain", 0, last, ids[:, 7:8], 7).logits
    tail.run("spec", 0, last, ids[:, :6], 0)
    out = tail.run("spec", 0, last, torch.tensor([[int(ids[0, 6]), 5, 5, 5, 5]]), 6, drafts=4)
    assert out.verify.shape == (5, 320) and torch.equal(out.verify[-1], out.logits)
    kv = tail.kv.get("spec")
    assert (kv.length, kv.drafted) == (11, 4)
    buffer = kv.cache.layers[0]._keys.data_ptr()
    with pytest.raises(CacheMissError):
        tail.run("spec", 0, last, ids[:, 5:6], 5)  # before the drafted positions: not a rollback
    got = tail.run("spec", 0, last, torch.tensor([[5]]), 7)  # no draft kept: the next step at 7, cut to 7
    assert kv.cache.layers[0]._keys.data_ptr() == buffer and tail.rolled_back == 4
    assert kv.length == 8 and kv.drafted == 0
    tail.run("plain2", 0, last, ids[:, :6], 0)
    tail.run("plain2", 0, last, ids[:, 6:7], 6)
    again = tail.run("plain2", 0, last, torch.tensor([[5]]), 7).logits
    if tail.w.dtype == torch.bfloat16:  # batch-invariant: position 6 in a chunk of 5 is the bits of a step
        assert torch.equal(got.logits, again)
    else:  # float32 with SDPA: a chunk and a step sum in other orders
        assert torch.allclose(got.logits, again, atol=1e-4)
    assert not torch.equal(got.logits, want)  # (a control: another token there gives other logits)


def test_a_sliding_window_layer_cuts_back_in_place_within_what_it_keeps():
    """A sliding-window layer, long past its window, cut back over 4 rejected drafts: the same
    buffer, and from then on it hands the attention exactly what a layer that never saw them
    hands it. Cut back further than it keeps, it refuses (the step is a cache miss)."""
    from types import SimpleNamespace

    from fabric.compute.cache import WindowLayer, roll_back

    torch.manual_seed(0)
    kv = lambda n: (torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4))  # noqa: E731
    spec, plain = WindowLayer(8), WindowLayer(8)
    for keys, values in (kv(1) for _ in range(150)):
        spec.update(keys, values)
        plain.update(keys, values)
    step = kv(5)  # the last token and 4 drafts
    spec.update(*step)
    plain.update(step[0][:, :, :1], step[1][:, :, :1])
    buffer = spec._keys.data_ptr()
    assert roll_back(SimpleNamespace(layers=[spec]), 0, 0, 151)
    assert spec._keys.data_ptr() == buffer and spec.get_seq_length() == plain.get_seq_length() == 151
    nxt = kv(1)
    assert all(torch.equal(a, b) for a, b in zip(spec.update(*nxt), plain.update(*nxt)))
    assert spec.first > 3 and not roll_back(SimpleNamespace(layers=[spec]), 0, 0, 10)  # gone: refused
    assert spec.get_seq_length() == 152


def test_a_verification_steps_tail_tap_covers_only_the_positions_kept(tiny_models):
    """The tail's AUDIT_TAP of a verification step (4 drafts, 1 kept) sketches the inputs of the
    positions kept and the logits that gave its last TOKEN, as a one-token step at the last kept
    position would have: a rejected draft never reaches the head's claims."""
    from fabric.compute.compute_lock import ComputeLock
    from fabric.node.scheduler import Work
    from fabric.node.taps import Taps, kernels
    from fabric.node.verdicts import sketch

    executor = ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(3, 5, 6), progress=False),
                             KVStore())
    taps = Taps(executor, ComputeLock(None), "tail", kernels("cpu", torch.float32, None), Counter())
    x = torch.randn(1, 11, 64, generator=torch.Generator().manual_seed(5))  # (1, positions, hidden)
    executor.run("s", 3, 5, x[:, :6], 0)
    result = executor.run("s", 3, 5, x[:, 6:], 6, drafts=4)  # positions 6..10
    best = [int(row.argmax()) for row in result.verify]
    drafts = (best[0], (best[1] + 1) % 320, best[2], best[3])  # the first kept, the second rejected
    msg = dataclasses.replace(_forward(drafts), pos=6, audit="t" * 32, tensors=(p.TensorSpec("float32", (1, 5, 64)),))
    tokens = SessionAsks().verify(msg, 7, result.verify)
    assert [t.token for t in tokens] == best[:2]
    tap, (inputs, outputs) = taps.tap(Work(msg, x[:, 6:]), result, tokens)
    assert (tap.pos, tap.token, inputs.shape[0], outputs.shape[0]) == (6, tokens[-1].token, 2, 1)
    assert torch.equal(inputs, sketch(x[:, 6:8])) and torch.equal(outputs, sketch(result.verify[1]))


def test_a_verification_step_of_a_batched_session_stays_in_its_row(tail):
    """Two sessions decode as rows of the batch group; one sends a verification step (a token
    and 3 drafts) in the same pass as the other's decode step. It runs in its row, in place
    (no copy out, no copy back: it stays in the group, and its next decode step batches with
    the other's), its logits are those of the same positions on a cache of its own, and after
    the tail rejects the drafts the next batched step cuts them off the row and goes on as
    if they had never been there."""
    from fabric.compute.executor import Chunk, Step

    last = 5
    prompt = torch.tensor([[1, 17, 40, 99, 23, 61]])  # (1, 6)
    for s in ("a", "b", "ref"):
        tail.run(s, 0, last, prompt, 0)
    tail.run_batch([Step(s, 0, last, torch.tensor([[7]]), 6) for s in ("a", "b")])  # both join the group
    group, row = tail.kv.get("b").group, tail.kv.get("b").row
    assert group is not None
    buffer = group.keys[0].data_ptr()
    tail.run("ref", 0, last, torch.tensor([[7]]), 6)
    step = Step("b", 0, last, torch.tensor([[8, 5, 5, 5]]), 7, drafts=3)
    a_out, b_out = tail.run_mixed([Step("a", 0, last, torch.tensor([[8]]), 7)], [Chunk(step)])
    want = tail.run("ref", 0, last, torch.tensor([[8, 5, 5, 5]]), 7, drafts=3)
    kv = tail.kv.get("b")
    assert (kv.group, kv.row, kv.length, kv.drafted) == (group, row, 11, 3) and int(group.lengths[row]) == 11
    assert group.keys[0].data_ptr() == buffer  # in place: the group's buffers were not rebuilt
    close = torch.equal if tail.w.dtype == torch.bfloat16 else lambda x, y: torch.allclose(x, y, atol=1e-4)
    assert close(b_out.verify, want.verify) and a_out.logits is not None
    # no draft kept: the next decode step comes at position 8, inside the drafts, batched with a's
    outs = tail.run_batch([Step(s, 0, last, torch.tensor([[9]]), 8) for s in ("a", "b")])
    assert kv.group is group and kv.row == row and kv.length == 9 and int(group.lengths[row]) == 9
    ref = tail.run("ref", 0, last, torch.tensor([[9]]), 8).logits  # cut back on its own cache the same way
    assert close(outs[1].logits, ref) and close(outs[1].logits, outs[0].logits)  # b's history is now a's
    assert not close(outs[1].logits, b_out.verify[1])  # (a control: the rejected draft there gave others)


# --------------------------------------------------------------------------- steps sent ahead


def test_a_step_sent_ahead_is_cut_off_with_the_drafts_it_assumed(tail):
    """A verification step (3 drafts) and one sent ahead of its answer (a guess and 2 drafts):
    the hop holds all 7 of their positions after the last confirmed one as drafted, so the next
    step may come anywhere among them, in place, and finds exactly the positions before it; the
    logits there are those of a session that never saw the rest. A step before them is a miss."""
    last = 5
    prompt = torch.tensor([[1, 17, 40, 99, 23, 61]])  # (1, 6)
    tail.run("spec", 0, last, prompt, 0)
    tail.run("spec", 0, last, torch.tensor([[7, 8, 9, 10]]), 6, drafts=3)  # positions 6..9
    kv = tail.kv.get("spec")
    assert (kv.length, kv.drafted) == (10, 3)
    tail.run("spec", 0, last, torch.tensor([[11, 12, 13]]), 10, drafts=2, guess=True)  # positions 10..12
    assert (kv.length, kv.drafted) == (13, 6)
    with pytest.raises(CacheMissError):
        tail.run("spec", 0, last, torch.tensor([[5]]), 6)  # the last confirmed position: not a rollback
    got = tail.run("spec", 0, last, torch.tensor([[5]]), 8)  # two drafts kept, the third rejected
    assert tail.rolled_back == 5 and (kv.length, kv.drafted) == (9, 0)
    tail.run("ref", 0, last, prompt, 0)
    tail.run("ref", 0, last, torch.tensor([[7, 8]]), 6)
    want = tail.run("ref", 0, last, torch.tensor([[5]]), 8).logits
    close = torch.equal if tail.w.dtype == torch.bfloat16 else lambda x, y: torch.allclose(x, y, atol=1e-4)
    assert close(got.logits, want)
    tail.run("spec", 0, last, torch.tensor([[6, 2, 3]]), 9, drafts=2)
    tail.run("spec", 0, last, torch.tensor([[4, 4]]), 12, drafts=1, guess=True)
    tail.run("spec", 0, last, torch.tensor([[4, 4]]), 14, drafts=1, guess=True)  # a chain of two sent ahead
    assert (kv.length, kv.drafted) == (16, 6)
    tail.run("spec", 0, last, torch.tensor([[3]]), 10)  # the first draft kept: everything after it goes
    assert (kv.length, kv.drafted) == (11, 0) and tail.rolled_back == 5 + 6


def test_the_tail_runs_a_step_sent_ahead_only_where_its_guess_held():
    """The tail answers a step sent ahead (``guess``) only where its last TOKEN of the session
    was the guess at the step's position: the step before kept every draft and the guess was
    the token after them. Otherwise nothing (None): no TOKEN, no tap, no count moved."""
    rows = torch.full((3, 6), -1.0)
    for i, best in enumerate([3, 1, 4]):
        rows[i, best] = 1.0
    asks = SessionAsks()
    assert [(t.token, t.pos) for t in asks.verify(_forward((3, 1)), 11, rows)] == [(3, 11), (1, 12), (4, 13)]
    asks.at_tail(_forward((3, 1)), 13, _Result(rows))  # the step before: positions 10..12, its TOKENs 11..13
    ahead = dataclasses.replace(_forward((3, 1)), pos=13, guess=4)  # it assumed 3 and 1 kept, and 4 after them
    assert [(t.token, t.pos) for t in asks.at_tail(ahead, 16, _Result(rows))] == [(3, 14), (1, 15), (4, 16)]
    assert asks.at_tail(dataclasses.replace(ahead, pos=16, guess=5), 19, _Result(rows)) is None  # 4 came there
    asks.at_tail(_forward((3, 2)), 13, _Result(rows))  # a step whose second draft is rejected: its last TOKEN at 12
    assert asks.at_tail(ahead, 16, _Result(rows)) is None
    assert asks.at_tail(dataclasses.replace(ahead, pos=12, guess=1), 15, _Result(rows))  # (a control)
    asks.forget("s")
    assert asks.at_tail(ahead, 16, _Result(rows)) is None  # a session the tail does not know: void


@dataclasses.dataclass
class _Result:
    verify: torch.Tensor

    @property
    def logits(self) -> torch.Tensor:
        return self.verify[-1]


def test_a_guess_is_a_token_id_on_a_step_with_drafts():
    ok = dataclasses.replace(_forward((1, 2)), guess=7)
    ok.validate()
    assert p.decode(p.encode(ok, [bytes(3 * 8 * 4)]))[0].guess == 7
    for change in (dict(guess=-2), dict(guess=2 ** 31), dict(drafts=(), tensors=(p.TensorSpec("float32", (1, 1, 8)),))):
        with pytest.raises(p.ProtocolError):
            dataclasses.replace(ok, **change).validate()
    plain = _forward((1, 2))
    assert b"guess" not in bytes(p.encode(plain, [bytes(3 * 8 * 4)])[2])  # not sent ahead: no byte for it


def test_a_step_is_sent_ahead_where_its_drafts_and_guess_likely_hold():
    """``ahead``: lookup's continuation of the drafts in flight, a guess and drafts after it,
    where every draft kept and the guess right (first * then^k) times what the step yields
    beats its positions' cost; never where lookup no longer continues those drafts, in a crowd,
    from a draft model, or with ``ahead`` off."""
    history = [1, 2, 3, 4] * 4
    spec = Speculation(SpeculationConfig(prior_accept=0.9))
    drafts = spec.drafts(history, 20)
    assert drafts == [1, 2, 3, 4, 1, 2] and spec.matched == 3
    ahead = spec.ahead(history, drafts, 20)
    assert ahead[:3] == [3, 4, 1] and 2 <= len(ahead) <= 7 and spec.aheads == 1
    assert spec.ahead(history, drafts, 2) == [3, 4]  # room for two tokens: the guess and one draft
    assert spec.ahead(history, [1, 2, 9], 20) == []  # lookup would not draft 9 there
    assert spec.ahead(history, [], 20) == [] and spec.ahead(history, drafts, 1) == []
    poor = Speculation(SpeculationConfig(prior_accept=0.3))
    assert poor.ahead(history, poor.drafts(history, 20) or [1], 20) == []  # seldom all kept: not worth it
    assert Speculation(SpeculationConfig(prior_accept=0.9), streams=2).ahead(history, drafts, 20) == []
    off = Speculation(SpeculationConfig(prior_accept=0.9, ahead="off"))
    assert off.ahead(history, off.drafts(history, 20), 20) == []


class _Recorder:
    """A transport that keeps the FORWARDs a RouteSession sends, and runs none."""

    def __init__(self):
        self.sent: list[p.Forward] = []

    def forward(self, hop, message, tensor) -> None:
        self.sent.append(message)

    def control(self, hop, message) -> None:
        pass


def _drafting_session(split, route, ahead: str):
    from fabric.node.route_session import RouteSession

    _, _, tok, _ = split
    request = p.Generate(request_id="r", route=route, prompt="x", max_tokens=40)
    transport = _Recorder()
    rs = RouteSession(request, [1, 2, 3, 4] * 4, tokenizer=tok, eos=frozenset(), reply_to="tcp://h:1",
                      transport=transport, seed=7,
                      speculation=Speculation(SpeculationConfig(adaptive=False, first_drafts=2, max_drafts=3,
                                                                ahead=ahead)))
    rs.start()
    return rs, transport


def test_a_head_sends_a_step_ahead_on_routes_that_leave_its_machine_and_follows_the_answers(split):
    """``auto``: a route whose hops all share the head's host sends no step ahead (its hops take
    turns on one machine's cores: no wait to fill), one that leaves it does, as ``on`` does any.
    A step sent ahead whose guess held is the pending step when the step before ends (its
    TOKENs count; the next one is sent ahead of it); one whose guess did not is ignored (a
    stray TOKEN of it changes nothing) and the next step goes at the last token taken."""
    here = (p.Hop("h", "tcp://10.0.0.1:5000", 0, 2), p.Hop("t", "tcp://10.0.0.1:5001", 3, 5))
    away = (here[0], dataclasses.replace(here[1], endpoint="tcp://10.0.0.2:5000"))
    for route, ahead, sends in ((here, "auto", False), (away, "auto", True), (here, "on", True), (away, "off", False)):
        rs, transport = _drafting_session(split, route, ahead)
        rs.on_token(p.Token("r", rs.step, 1, 16))  # the prompt's token: the first decode step follows
        assert [m.guess >= 0 for m in transport.sent[1:]] == [False, True][:1 + sends], (route, ahead)
    rs, transport = _drafting_session(split, away, "auto")
    rs.on_token(p.Token("r", rs.step, 1, 16))
    step, guessed = transport.sent[1:3]
    assert (step.pos, step.drafts, guessed.pos, guessed.guess, guessed.drafts) == (16, (2, 3), 19, 4, (1, 2, 3))
    for token, pos in ((2, 17), (3, 18), (4, 19)):  # both drafts kept, and the guess was the token after them
        rs.on_token(p.Token("r", step.step, token, pos))
    assert rs.step == guessed.step and rs.speculation.aheads_held == 1 and rs.history[-3:] == [2, 3, 4]
    assert transport.sent[-1].guess == 4 and transport.sent[-1].pos == 23  # the next, ahead of it in turn
    for token, pos in ((1, 20), (2, 21), (9, 22)):  # its last draft rejected: 9 instead of 3
        rs.on_token(p.Token("r", guessed.step, token, pos))
    void, fresh = transport.sent[-2:]
    assert fresh.guess == -1 and fresh.pos == 22 and fresh.step > void.step and rs.step == fresh.step
    rs.on_token(p.Token("r", void.step, 1, 24))  # a stray answer of the void step: stale
    assert rs.history[-1] == 9 and len(rs.generated) == 7
