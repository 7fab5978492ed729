"""Audits without sockets: sketches and the majority (verdicts), the head's auditor as a state
machine over a recording host, the hop's taps and replays on a real shard, and the tracker's
replicas, listings and verdicts."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from fabric.compute.compute_lock import ComputeLock
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.node.audit import REPLAY_S_PER_POSITION, TAP_GRACE_S, AuditConfig, Auditor
from fabric.node.replica_watch import RECHECK_S, TRUST_S
from fabric.node.scheduler import HopScheduler, Replay, SchedulerConfig, Work
from fabric.node.taps import Taps, kernels
from fabric.node.verdicts import Claim, Outcome, disagreement, distance, judge, sketch
from fabric.wire import protocol as p
from fabric.wire.shard import Shard

HEAD = p.Hop("head", "tcp://head", 0, 2, key="K-head")
TAIL = p.Hop("tail", "tcp://tail", 3, 5, key="K-tail")
R1, R2, R3 = (p.Hop(f"r{i}", f"tcp://r{i}", 3, 5, key=f"K-r{i}") for i in (1, 2, 3))
VOCAB, HIDDEN = 40, 8
PROMPT = [5, 6, 7, 8]


def logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))  # (vocab,)


# --------------------------------------------------------------------------- verdicts


def test_a_sketch_keeps_distances_roughly_and_a_reversed_output_far():
    x = torch.randn(50, 576, generator=torch.Generator().manual_seed(0))  # (positions, hidden)
    noisy = x + 0.03 * x.norm(dim=1, keepdim=True) / 24 * torch.randn(50, 576)  # ~3% relative noise a row
    assert sketch(x).shape == (50, p.SKETCH_DIM) and torch.equal(sketch(x), sketch(x.clone()))
    honest = [distance(a, b) for a, b in zip(sketch(noisy), sketch(x))]
    lying = [distance(a, b) for a, b in zip(sketch(x.flip(-1)), sketch(x))]
    assert max(honest) < 0.1 < min(lying), (max(honest), min(lying))


def _claim(node, seeds, positions=(4, 5), tokens=(), with_logits=False):
    rows = torch.stack([logits(s) for s in seeds])  # (n, vocab)
    return Claim(node, sketch(rows), tuple(positions), tokens=tuple(tokens), logits=rows if with_logits else None)


@pytest.mark.parametrize("seeds,more,outcome,liar,witnesses", [
    (((0, 1),), True, Outcome.ASK, "", ()),
    (((0, 1), (0, 1)), False, Outcome.PASS, "", ()),
    (((0, 9), (0, 1)), True, Outcome.ASK, "", ("r1",)),
    (((0, 9), (0, 1)), False, Outcome.UNSETTLED, "", ("r1",)),
    (((0, 9), (0, 1), (0, 1)), False, Outcome.LIAR, "s", ("r1", "r2")),  # the second position lied
    (((0, 1), (0, 9), (0, 1)), False, Outcome.ODD_REPLICA, "r1", ("r2",)),  # a replica lied: nobody convicted
    (((0, 1), (0, 9), (7, 8)), False, Outcome.UNSETTLED, "", ("r1", "r2")),  # three different outputs
])
def test_judge_needs_two_replicas_that_agree(seeds, more, outcome, liar, witnesses):
    suspect, *replicas = [_claim(n, s) for n, s in zip(("s", "r1", "r2"), seeds)]
    verdict = judge(suspect, replicas, more)
    assert (verdict.outcome, verdict.liar, verdict.witnesses) == (outcome, liar, witnesses)


def test_a_mismatch_just_over_the_tolerance_is_reported_not_convicted():
    x = torch.stack([logits(0), logits(1)])  # (positions, vocab)
    nudged = x.clone()
    nudged[1] += 0.15 * x[1].norm() / x.shape[1] ** 0.5 * torch.randn(x.shape[1], generator=torch.Generator().manual_seed(5))
    suspect, r1, r2 = Claim("s", sketch(nudged), (4, 5)), Claim("r1", sketch(x), (4, 5)), Claim("r2", sketch(x), (4, 5))
    assert disagreement(suspect, r1)  # over the tolerance of 0.1...
    assert judge(suspect, [r1, r2], more=False).outcome == Outcome.UNSETTLED  # ...but not three times over


def test_a_tails_token_must_be_the_one_the_replicas_logits_clearly_give():
    rows = torch.stack([logits(0), logits(1)])
    best = [int(r.argmax()) for r in rows]
    replica = Claim("r1", sketch(rows), (4, 5), logits=rows)
    assert disagreement(Claim("t", sketch(rows), (4, 5), tokens=tuple(best)), replica) == ""
    worst = int(rows[1].argmin())
    assert "token" in disagreement(Claim("t", sketch(rows), (4, 5), tokens=(best[0], worst)), replica)
    assert disagreement(Claim("t", sketch(rows), (4, 5), tokens=(best[0], worst)), replica, greedy=False) == ""
    tie = rows.clone()
    tie[1, worst] = tie[1, best[1]] - 1e-4  # a near-tie: either token is honest
    near = Claim("r1", sketch(tie), (4, 5), logits=tie)
    assert disagreement(Claim("t", sketch(tie), (4, 5), tokens=(best[0], worst)), near) == ""


# --------------------------------------------------------------------------- the head's auditor


class Host:
    """The node as the auditor sees it, recording what goes out."""

    endpoint = "tcp://head"

    def __init__(self, key: str = ""):
        self.key = key
        self.forwarded, self.sent, self.tracker = [], [], []
        self.has_tracker = True

    def forward(self, hop, message, tensor):
        self.forwarded.append(message)

    def control(self, hop, message):
        pass

    def send_tensors(self, endpoint, key, message, tensors):
        self.sent.append((endpoint, message, tensors))

    def to_tracker(self, message):
        self.tracker.append(message)
        return self.has_tracker


class Rig:
    """One request through HEAD and ``route``'s hops: its steps, the hops' taps, the replay."""

    def __init__(self, rate: float = 1.0, route: tuple[p.Hop, ...] = (HEAD, TAIL), key: str = "",
                 session: str = "s"):
        self.host, self.around, self.counters = Host(key), [], Counter()
        self.auditor = Auditor(AuditConfig(audit_rate=rate, audit_timeout=10.0), self.host, "head", "tiny", "fp",
                               self.counters, self.around.append, rng=random.Random(0))
        self.route, self.session = route, session
        self.drawn = self.auditor.draw(session, PROMPT)

    @property
    def tap(self) -> str:
        return self.host.forwarded[-1].audit

    def step(self, step: int, ids: list[int], pos: int) -> p.Forward:
        msg = p.Forward(session=self.session, step=step, pos=pos, start_layer=0, end_layer=2,
                        route=self.route[1:], reply_to="tcp://head")
        self.auditor.forward(self.route[0], msg, torch.tensor([ids]))
        return self.host.forwarded[-1]

    def tail_tap(self, step: int, pos: int, q: int, seed: int, token: int | None = None, tap: str | None = None,
                 sender: str = "", hop: p.Hop = TAIL):
        out = sketch(logits(seed))  # (1, SKETCH_DIM)
        token = int(logits(seed).argmax()) if token is None else token
        msg = p.AuditTap(tap or self.tap, self.session, step, pos, hop.start_layer, hop.end_layer, token=token)
        self.auditor.received(msg, [sketch(torch.ones(q, HIDDEN) * (pos + 1)), out], sender)

    def serve(self, seeds: list[int], **tap):
        """The prefill (its logits from seeds[0]) and a decode step for each further seed."""
        self.step(0, PROMPT, 0)
        self.tail_tap(0, 0, len(PROMPT), seeds[0], **tap)
        for i, seed in enumerate(seeds[1:], 1):
            pos = len(PROMPT) + i - 1
            self.step(i, [9], pos)
            self.tail_tap(i, pos, 1, seed, **tap)

    def end(self):
        self.auditor.ended(self.session, now=0.0)
        self.auditor.tick(TAP_GRACE_S)  # the replay starts once the last taps had time to come

    def own_layers(self, n: int | None = None):
        """This head's own re-run (stage 0) answers: hidden states of the replayed positions."""
        endpoint, msg, (ids,) = self.host.sent[-1]
        assert endpoint == "tcp://head" and msg.start_layer == 0 and ids.dtype == torch.int64
        self.result(msg.audit, torch.zeros(1, ids.shape[1], HIDDEN), sender=self.host.key)

    def replicas(self, *hops: p.Hop, suspect_key: str = ""):
        ask = self.host.tracker[-1]
        assert isinstance(ask, p.ReplicasRequest) and ask.node_id == "head" and ask.suspect == self.route[1].node
        self.auditor.replicas(p.Replicas(ask.audit, hops, suspect_key=suspect_key))

    def answer(self, seeds: list[int] | None, sender: str | None = None):
        """The last asked replica answers with the logits of seeds (None: an error)."""
        endpoint, msg, _ = self.host.sent[-1]
        hop = next(h for h in (R1, R2, R3) if h.endpoint == endpoint)
        output = None if seeds is None else torch.stack([logits(s) for s in seeds])  # positions logits_from..
        self.result(msg.audit, output, sender=hop.key if sender is None else sender)

    def result(self, audit: str, output: torch.Tensor | None, sender: str = ""):
        msg = p.AuditResult(audit, error="" if output is not None else "no")
        self.auditor.received(msg, [] if output is None else [output], sender)

    @property
    def asked(self) -> list[str]:
        return [endpoint for endpoint, msg, _ in self.host.sent if isinstance(msg, p.Audit) and msg.start_layer]

    @property
    def verdicts(self) -> list[p.Verdict]:
        return [m for m in self.host.tracker if isinstance(m, p.Verdict)]


HONEST = [10, 11, 12, 13]  # the tail's logits at the prompt's last position and three decode steps


def test_every_forward_carries_a_tap_id_and_audited_ones_look_the_same():
    audited, other = Rig(rate=1.0), Rig(rate=1.0, session="x")
    other.auditor.kept.clear()  # as if not drawn
    a, b = audited.step(0, PROMPT, 0), other.step(0, PROMPT, 0)
    assert len(a.audit) == len(b.audit) == 32 and a.audit != b.audit
    assert a == p.Forward(**{**vars(b), "session": a.session, "audit": a.audit})  # nothing else tells them apart
    assert audited.step(1, [9], 4).audit == a.audit  # every step of a session: its one tap id
    assert Rig(rate=0.0).step(0, PROMPT, 0).audit == ""  # a head that audits nothing asks for no taps


def test_the_rate_is_the_share_of_requests_kept():
    rig = Rig(rate=0.25)
    drawn = 0
    for i in range(4000):
        drawn += rig.auditor.draw(f"s{i}", PROMPT)
        rig.auditor.ended(f"s{i}", now=0.0)  # nothing ran: nothing to replay
        rig.auditor.tick(TAP_GRACE_S)
    assert 0.22 < drawn / 4000 < 0.28 and len(rig.auditor.kept) <= 1 and set(rig.auditor.tap_ids) == {"s"}


def test_a_tap_that_follows_the_last_token_still_counts():
    """Hops send a pass's taps after all its tokens: the last step's tap may reach the head
    after the request ended there. The replay waits TAP_GRACE_S for it."""
    late, never = Rig(), Rig()
    for rig in (late, never):
        rig.serve(HONEST[:-1])
        rig.step(3, [9], len(PROMPT) + 2)
        rig.auditor.ended(rig.session, now=0.0)
    late.tail_tap(3, len(PROMPT) + 2, 1, HONEST[-1])
    for rig in (late, never):
        assert not any(isinstance(msg, p.Audit) for _, msg, _ in rig.host.sent)  # not before the grace
        rig.auditor.tick(TAP_GRACE_S)
        rig.replicas(R1)
    assert [rig.host.sent[-1][2][0].shape[1] for rig in (late, never)] == [len(PROMPT) + 3, len(PROMPT) + 2]


def _replay(rig: Rig, first: list[int], second: list[int] | None = None, *replicas: p.Hop):
    rig.end()
    rig.replicas(*(replicas or (R1, R2, R3)))
    rig.own_layers()
    rig.answer(first)
    if second is not None:
        rig.answer(second)


def test_a_tail_lying_on_decode_steps_only_is_convicted_by_two_replicas():
    rig = Rig()
    rig.serve([10, 91, 92, 93])  # honest prefill logits, decode steps' wrong
    _replay(rig, HONEST, HONEST)
    assert rig.asked == ["tcp://r1", "tcp://r2"]
    (verdict,) = rig.verdicts
    assert (verdict.suspect, verdict.witnesses, verdict.settled) == ("tail", ("r1", "r2"), True)
    assert "position 5" in verdict.detail or "positions apart" in verdict.detail
    assert rig.around == ["tail"] and rig.auditor.convicted == {"tail"} and rig.counters["audits_convicted"] == 1


def test_an_honest_tail_passes_on_one_replica():
    rig = Rig()
    rig.serve(HONEST)
    _replay(rig, HONEST)
    assert rig.asked == ["tcp://r1"] and rig.verdicts == [] and rig.counters["audits_passed"] == 1
    assert rig.auditor.kept == {} and rig.auditor.reruns == {}


def test_a_wrong_token_from_honest_logits_is_caught():
    rig = Rig()
    rig.serve([10], token=int(logits(10).argmin()))
    _replay(rig, [10], [10])
    assert rig.verdicts[0].settled and "token" in rig.verdicts[0].detail


@pytest.mark.parametrize("how", ["one replica", "a lying replica", "three outputs"])
def test_nobody_is_convicted_without_two_agreeing_replicas(how):
    rig = Rig()
    rig.serve([10, 91, 92, 93] if how != "a lying replica" else HONEST)
    if how == "one replica":
        _replay(rig, HONEST, None, R1)
    elif how == "a lying replica":
        _replay(rig, [10, 71, 72, 73], HONEST)  # r1 lies; the tail and r2 agree
    else:
        _replay(rig, HONEST, [10, 61, 62, 63])
    (verdict,) = rig.verdicts
    assert not verdict.settled and rig.around == [] and rig.auditor.convicted == set()
    if how == "a lying replica":  # the tail passes; r1's mismatch is reported, against r1
        assert (verdict.suspect, verdict.witnesses) == ("r1", ("r2",)) and rig.counters["audits_passed"] == 1
    else:
        assert verdict.suspect == "tail" and rig.counters["audits_unsettled"] == 1


def test_forged_taps_are_ignored_and_the_first_tap_of_a_step_counts():
    rig = Rig()
    rig.step(0, PROMPT, 0)
    rig.tail_tap(0, 0, len(PROMPT), 91, tap="0" * 32)  # a stranger's guess at the tap id: dropped
    rig.tail_tap(0, 0, len(PROMPT), 10)  # the tail's own
    rig.tail_tap(0, 0, len(PROMPT), 91)  # a second tap of the same step: ignored
    for i, seed in enumerate(HONEST[1:], 1):
        rig.step(i, [9], 3 + i)
        rig.tail_tap(i, 3 + i, 1, seed)
    _replay(rig, HONEST)
    assert rig.verdicts == [] and rig.counters["audits_passed"] == 1
    assert rig.counters["audit_frames_ignored"] == 2


def test_forged_results_are_ignored_and_each_replica_has_its_own_id():
    rig = Rig()
    rig.serve([10, 91, 92, 93])
    rig.end()
    rig.replicas(R1, R2)
    rig.own_layers()
    first = rig.host.sent[-1][1].audit
    rig.result("f" * 32, torch.stack([logits(s) for s in [10, 91, 92, 93]]))  # an id nobody was sent
    rig.answer(HONEST)
    rig.result(first, torch.stack([logits(s) for s in [10, 91, 92, 93]]))  # r1's id once more: spent
    second = rig.host.sent[-1][1].audit
    assert second != first and len(second) == 32
    rig.answer(HONEST)
    assert rig.verdicts[0].settled and rig.verdicts[0].witnesses == ("r1", "r2")
    assert rig.counters["audit_frames_ignored"] == 2


def test_in_a_curve_swarm_keys_decide_who_answered():
    rig = Rig(key="K-head")
    rig.serve([10, 91, 92, 93], sender="K-tail")
    rig.end()
    rig.replicas(R1, R2, suspect_key="K-tail")
    rig.own_layers()
    rig.answer(HONEST, sender="K-stranger")  # r1's id, from another key: ignored
    assert rig.counters["audit_frames_ignored"] == 1 and rig.asked == ["tcp://r1"]
    rig.answer(HONEST)
    rig.answer(HONEST)
    assert rig.verdicts[0].settled

    forged = Rig(key="K-head")
    forged.serve([10, 91, 92, 93], sender="K-liar")  # taps of the tail's span from a key not the tail's
    forged.end()
    forged.replicas(R1, R2, suspect_key="K-tail")
    assert forged.verdicts == [] and forged.host.sent == [] and forged.counters["audits_skipped"] == 1


def test_a_hop_whose_input_already_differs_is_not_judged():
    mid, tail = p.Hop("mid", "tcp://mid", 3, 4), p.Hop("tail", "tcp://tail", 5, 5)
    rig = Rig(route=(HEAD, mid, tail))
    rig.step(0, PROMPT, 0)
    out = torch.zeros(len(PROMPT), HIDDEN)
    rig.auditor.received(p.AuditTap(rig.tap, "s", 0, 0, 3, 4), [sketch(torch.zeros(4, HIDDEN)), sketch(out)])
    rig.tail_tap(0, 0, len(PROMPT), 91, hop=tail)  # its input sketch: not what mid's layers give (zeros)
    rig.end()
    ask = rig.host.tracker[-1]
    m1 = p.Hop("m1", "tcp://r1", 3, 4, key="K-r1")
    rig.auditor.replicas(p.Replicas(ask.audit, (m1,)))
    rig.own_layers()
    rig.result(rig.host.sent[-1][1].audit, torch.zeros(1, len(PROMPT), HIDDEN))  # mid agrees with its replica
    (verdict,) = rig.verdicts
    assert verdict.suspect == "tail" and not verdict.settled and "received other hidden states" in verdict.detail
    assert rig.around == []


def test_no_replica_of_the_next_hop_skips_the_audit_before_the_head_replays_its_own_layers():
    """In a swarm that holds no other copy of the tail's layers (`meshnet up`, most LANs) nobody
    could check the tail: the head's own replay, a prefill of the stretch that holds its streams
    up, would be for nothing. It asks the tracker first, and runs nothing."""
    for hops in ((), (p.Hop("tail", "tcp://tail", 3, 5),)):  # nobody, or only the suspect itself
        rig = Rig()
        rig.serve(HONEST)
        rig.end()
        assert rig.host.sent == []  # nothing replayed before the tracker answers
        rig.replicas(*hops)
        assert rig.host.sent == [] and rig.counters["audits_skipped"] == 1 and rig.auditor.reruns == {}
    rig = Rig()
    rig.serve(HONEST)
    rig.end()
    rig.replicas(R1)
    (own,) = rig.host.sent  # a replica can check: the head's own layers first
    assert own[0] == "tcp://head" and own[1].start_layer == 0
    rig.own_layers()
    assert rig.asked == ["tcp://r1"]


def test_a_hop_nobody_could_check_is_asked_for_no_taps_until_a_replica_joins():
    """`meshnet up`'s split holds no other copy of its tail's layers, and taps nobody could read
    cost 8 streams a tenth of their tokens. The head asks the tracker who else holds the first
    hop past it, as an audit would; while the answer names nobody, a request gets no tap id (every
    request alike) and is not drawn. The answer is asked again every RECHECK_S, so a replica that
    joins is tapped for; a "nobody" goes unbelieved TRUST_S after it came, answered or not."""
    rig = Rig(rate=1.0)
    auditor, counters = rig.auditor, rig.counters
    asks = lambda: [m for m in rig.host.tracker if isinstance(m, p.ReplicasRequest)]  # noqa: E731
    assert auditor.draw("a", PROMPT, TAIL, now=0.0)  # unknown: tapped, and the tracker asked
    (ask,) = asks()
    assert (ask.start_layer, ask.end_layer, ask.suspect) == (3, 5, "") and {"tail", "head"} <= set(ask.exclude)
    auditor.replicas(p.Replicas(ask.audit, (p.Hop("tail", "tcp://tail", 3, 5),)))  # only the hop itself: nobody
    assert not auditor.draw("b", PROMPT, TAIL, now=1.0) and counters["audits_untapped"] == 1 and len(asks()) == 1
    msg = p.Forward(session="b", step=0, pos=0, start_layer=0, end_layer=2, route=(TAIL,), reply_to="tcp://head")
    auditor.forward(HEAD, msg, torch.tensor([PROMPT]))
    assert rig.host.forwarded[-1].audit == ""  # its hops tap nothing
    other = p.Hop("tail2", "tcp://tail2", 3, 5)
    assert auditor.draw("c", PROMPT, other, now=2.0) and len(asks()) == 2  # another hop: asked on its own
    auditor.replicas(p.Replicas(asks()[-1].audit, (R1,)))
    assert auditor.draw("d", PROMPT, other, now=3.0) and len(asks()) == 2
    assert not auditor.draw("e", PROMPT, TAIL, now=RECHECK_S) and len(asks()) == 3  # asked again, not yet answered
    auditor.replicas(p.Replicas(ask.audit, ()))  # the old question's answer, again: changes nothing
    auditor.replicas(p.Replicas(asks()[-1].audit, (R1,)))  # a replica joined
    assert auditor.draw("f", PROMPT, TAIL, now=RECHECK_S + 1)
    auditor.replicas(p.Replicas(asks()[-1].audit, ()))  # answered twice: the first answer stands
    assert auditor.draw("g", PROMPT, TAIL, now=RECHECK_S + 2)
    auditor.draw("h", PROMPT, TAIL, now=2 * RECHECK_S)
    auditor.replicas(p.Replicas(asks()[-1].audit, ()))  # it left again
    assert not auditor.draw("i", PROMPT, TAIL, now=2 * RECHECK_S + 1)
    rig.host.has_tracker = False  # the tracker is gone: the questions go nowhere, and "nobody" lapses
    assert not auditor.draw("j", PROMPT, TAIL, now=2 * RECHECK_S + TRUST_S - 1)
    assert auditor.draw("k", PROMPT, TAIL, now=2 * RECHECK_S + TRUST_S)
    assert counters["audits_untapped"] == 4 and set(auditor.tap_ids) == {"s", "a", "c", "d", "f", "g", "h", "k"}


def test_a_longer_stretch_has_longer_to_answer():
    """A replica runs a replay in slices between its streams' decode batches: the head waits
    REPLAY_S_PER_POSITION longer per position before it gives up."""
    rig = Rig()
    rig.serve(HONEST)
    rig.end()
    rig.replicas(R1)
    rig.own_layers()
    (rerun,) = {id(r): r for r in rig.auditor.reruns.values()}.values()
    due = rerun.moved + rig.auditor.config.audit_timeout
    rig.auditor.tick(due + 0.5 * REPLAY_S_PER_POSITION * rerun.n)
    assert rig.counters["audits_skipped"] == 0 and rerun.n == len(PROMPT) + 3
    rig.auditor.tick(due + 1.1 * REPLAY_S_PER_POSITION * rerun.n)  # past it by more than a clock's rounding
    assert rig.counters["audits_skipped"] == 1


def test_a_replay_that_hears_nothing_gives_up():
    rig = Rig()
    rig.serve([10, 91, 92, 93])
    _replay(rig, HONEST)  # r1 disagrees; r2 never answers
    rig.auditor.tick(float("inf"))
    assert rig.verdicts[0].settled is False and rig.around == []
    quiet = Rig()
    quiet.serve(HONEST)
    quiet.end()
    quiet.auditor.tick(float("inf"))
    assert quiet.counters["audits_skipped"] == 1 and quiet.auditor.kept == {}


# --------------------------------------------------------------------------- the hop's side


@pytest.fixture(scope="module")
def tail(tiny_models) -> ShardExecutor:
    return ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(3, 5, 6), progress=False), KVStore())


def _forward(pos: int, tap: str = "t" * 32) -> p.Forward:
    return p.Forward(session="s", step=pos, pos=pos, start_layer=3, end_layer=5, route=(), reply_to="tcp://head",
                     audit=tap)


def _decode(executor: ShardExecutor, taps: Taps, x: torch.Tensor, prompt: int) -> list:
    """A prefill of ``prompt`` positions then decode steps, as a tail runs them: its taps."""
    out = [taps.tap(Work(_forward(0), x[:, :prompt]), executor.run("s", 3, 5, x[:, :prompt], 0))]
    for pos in range(prompt, x.shape[1]):
        out.append(taps.tap(Work(_forward(pos), x[:, pos:pos + 1]), executor.run("s", 3, 5, x[:, pos:pos + 1], pos)))
    return out


def test_a_replay_in_one_pass_agrees_with_the_steps_a_tail_ran_one_by_one(tail):
    taps = Taps(tail, ComputeLock(None), "tail", kernels("cpu", torch.float32, None), Counter())
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))  # (1, positions, hidden)
    tapped = _decode(tail, taps, x, prompt=5)
    assert [len(t[1]) for t in tapped] == [2] * 5 and all(t[0].token >= 0 for t in tapped)
    answer, (replayed,) = taps.replay(Replay(p.Audit("a1", 3, 5, "tcp://head", logits_from=4), x[:, :9]))
    assert answer.error == "" and replayed.shape == (5, 320)  # positions 4..8: the prompt's last, four decode steps
    honest = Claim("tail", torch.cat([t[1][1] for t in tapped]), (4, 5, 6, 7, 8), tokens=tuple(t[0].token
                                                                                                for t in tapped))
    replica = Claim("r1", sketch(replayed), (4, 5, 6, 7, 8), logits=replayed)
    assert disagreement(honest, replica) == "" and "audit:a1" not in tail.kv
    import tests.liar_node as liar  # every executor lies from here on: put the honest one back after

    try:
        liar.lie("decode")
        lying = _decode(tail, taps, x, prompt=5)
    finally:
        liar.honest()
    assert torch.equal(lying[0][1][1], tapped[0][1][1])  # its prefill: honest
    claim = Claim("tail", torch.cat([t[1][1] for t in lying]), (4, 5, 6, 7, 8), tokens=())
    assert "positions apart" in disagreement(claim, replica)


def test_a_long_replay_runs_in_slices_and_answers_what_one_pass_gives(tail, tiny_models):
    """A replay in slices (each a turn between the node's decode batches) gives the outputs of one
    pass: the tail's logits of the window, a first hop's hidden states of every position."""
    taps = Taps(tail, ComputeLock(None), "tail", "", Counter())
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(4))
    _, (whole,) = taps.replay(Replay(p.Audit("w", 3, 5, "tcp://head", logits_from=4), x))
    job = Replay(p.Audit("s", 3, 5, "tcp://head", logits_from=4), x)
    assert taps.replay(job, 3) is None and taps.replay(job, 3) is None and "audit:s" in tail.kv
    answer, (sliced,) = taps.replay(job, 3)
    assert answer.error == "" and sliced.shape == whole.shape == (5, 320) and "audit:s" not in tail.kv
    assert torch.allclose(sliced, whole, rtol=1e-4, atol=1e-4)
    first = ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(0, 2, 6), progress=False), KVStore())
    taps = Taps(first, ComputeLock(None), "head", "", Counter())
    ids = torch.arange(3, 12)[None]
    _, (whole,) = taps.replay(Replay(p.Audit("w", 0, 2, "tcp://head"), ids))
    job = Replay(p.Audit("s", 0, 2, "tcp://head"), ids)
    while (answer := taps.replay(job, 4)) is None:
        pass
    assert whole.shape == answer[1][0].shape == (1, 9, 64) and torch.allclose(answer[1][0], whole, rtol=1e-4, atol=1e-4)
    assert taps.counters["audit_replays"] == 2


def test_a_replay_it_cannot_run_is_an_error(tail):
    taps = Taps(tail, ComputeLock(None), "tail", "", Counter())
    answer, tensors = taps.replay(Replay(p.Audit("a2", 1, 5, "tcp://head"), torch.zeros(1, 3, 64)))
    assert "outside this node's shard" in answer.error and tensors == []


def test_kernels_name_exact_mode_only():
    assert kernels("cpu", torch.float32, None).startswith(f"torch {torch.__version__} cpu ")
    assert kernels("cpu", torch.bfloat16, None) == kernels("cpu", torch.float32, "int8") == ""


def test_replays_take_turns_with_decode_batches_in_the_scheduler():
    sched = HopScheduler(SchedulerConfig(), live={"d"})
    replay = Replay(p.Audit("a", 3, 5, "h"), torch.zeros(1, 40, 8))
    assert sched.push_replay(replay) and len(sched) == 1
    decode = p.Forward(session="d", step=1, pos=9, start_layer=3, end_layer=5, route=(), reply_to="h")
    sched.push(Work(decode, torch.zeros(1, 1, 8)))
    sched.ran_prefill = True  # a prompt just ran: the decode batch goes first
    assert [w.session for w in sched.next_batch()] == ["d"]
    sched.push(Work(decode, torch.zeros(1, 1, 8)))
    assert sched.next_batch() == [replay]  # then the replay, before the next decode batch
    assert [w.session for w in sched.next_batch()] == ["d"]
    assert all(sched.push_replay(replay) for _ in range(8)) and not sched.push_replay(replay)  # bounded


def test_a_long_replay_takes_slices_with_decode_batches_between():
    """A replay of a long stretch would hold every stream here up for a prefill's time: it runs a
    prompt's slice a turn, the decode batches between, and goes on first at its next turn."""
    sched = HopScheduler(SchedulerConfig(), live={"d"})
    sched.slice_tokens["busy"] = 32.0
    long, short = (Replay(p.Audit(a, 3, 5, "h"), torch.zeros(1, n, 8)) for a, n in (("a", 200), ("b", 40)))
    assert sched.replay_slice(short) == 40  # under a whole prompt's size: at once
    decode = p.Forward(session="d", step=1, pos=9, start_layer=3, end_layer=5, route=(), reply_to="h")
    assert sched.push_replay(long) and sched.push_replay(short)
    turns = []
    while len(sched):
        sched.push(Work(decode, torch.zeros(1, 1, 8)))
        batch = sched.next_batch()
        if isinstance(batch[0], Replay):
            batch[0].done += sched.replay_slice(batch[0])
            turns.append((batch[0].msg.audit, batch[0].done))
            if batch[0].done < batch[0].tokens:
                sched.resume_replay(batch[0])
        else:
            turns.append("decode")
        if len(turns) > 40:
            break
    replays = [t for t in turns if t != "decode"]
    assert replays == [("a", 32), ("a", 64), ("a", 96), ("a", 128), ("a", 160), ("a", 200), ("b", 40)]  # the last 40: at once
    assert all(turns[i + 1] == "decode" for i, t in enumerate(turns[:-1]) if t != "decode")  # the streams' turn between


# --------------------------------------------------------------------------- the tracker's side


def _tracker(clock=None):
    from tracker.service import Tracker, TrackerConfig

    tracker = Tracker(TrackerConfig(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*", db=":memory:"),
                      **({"clock": clock} if clock else {}))
    for node, start, end, fp in (("head", 0, 2, "fp"), ("t1", 3, 5, "fp"), ("t2", 3, 5, "fp"), ("full", 0, 5, "fp"),
                                 ("other", 3, 5, "fp2"), ("liar", 3, 5, "fp")):
        tracker.handle(p.Register(node_id=node, endpoint=f"tcp://{node}", model="tiny", fingerprint=fp,
                                  num_layers=6, start_layer=start, end_layer=end))
    tracker.handle(p.Heartbeat("t1", sessions=3))
    return tracker


def _ask(tracker, head="head", suspect="liar"):
    return tracker.handle(p.ReplicasRequest("a1", "tiny", "fp", 3, 5, exclude=(suspect, head), node_id=head,
                                            suspect=suspect))


def test_the_tracker_names_replicas_of_the_same_weights_least_loaded_first():
    tracker = _tracker()
    answer = _ask(tracker)
    assert answer.audit == "a1" and [h.node for h in answer.hops] == ["full", "t2", "t1"]
    assert {(h.start_layer, h.end_layer) for h in answer.hops} == {(3, 5)}
    assert tracker.audits.listed("head", "liar") == {"full", "t2", "t1"}
    assert tracker.audits.listed("head", "t1") == set() and tracker.audits.listed("full", "liar") == set()


def test_a_settled_verdict_excludes_the_liar_for_a_term_and_a_second_confirms_it():
    now = [0.0]
    tracker = _tracker(clock=lambda: now[0])
    tracker.audits.clock = lambda: now[0]
    _ask(tracker)
    verdict = p.Verdict("head", "tiny", "liar", 3, 5, witnesses=("t1", "t2"), settled=True, detail="1.04")
    assert tracker.handle(verdict).detail == "excluded"
    status = tracker.status_body()
    rows = {n["id"]: n for n in status["nodes"]}
    assert "wrong results" in rows["liar"]["excluded"] and "t1 and t2" in rows["liar"]["excluded"]
    assert rows["t1"]["excluded"] == ""
    assert all(h["node"] != "liar" for route in status["plans"]["tiny"] for h in route["hops"])
    assert "liar" not in {h.node for h in _ask(tracker, suspect="t1").hops}
    (event,) = [e for e in status["events"] if e["kind"] == "audit"]
    assert (event["node"], event["code"], event["by"], event["witnesses"]) == ("liar", "liar", "head", ["t1", "t2"])
    assert event["lapses_in"] == 3600
    now[0] = 3000.0
    assert tracker.handle(verdict).detail == "confirmed"  # its term starts again
    now[0] = 6000.0
    assert tracker.registry.excluded_for("liar") > 0
    for n in ("head", "t1", "t2", "full", "liar"):
        tracker.handle(p.Heartbeat(n))
    now[0] = 6700.0  # no verdict for an hour: it lapses
    for n in ("head", "t1", "t2", "full", "liar"):
        tracker.handle(p.Heartbeat(n))
    tracker.registry.expire()
    assert tracker.registry.excluded == {} and "liar" in {n.node_id for n in tracker.registry.snapshot()}


@pytest.mark.parametrize("who,witnesses,match", [
    ("stranger", ("t1", "t2"), "not registered"),  # no head of this swarm
    ("full", ("t1", "t2"), "named no replica"),  # a head the tracker gave no replicas for that suspect
    ("head", ("t1", "other"), "named no replica other"),  # a witness the tracker never named to it
])
def test_a_verdict_without_an_audit_behind_it_is_refused(who, witnesses, match):
    tracker = _tracker()
    _ask(tracker)
    with pytest.raises(p.ProtocolError, match=match):
        tracker.handle(p.Verdict(who, "tiny", "liar", 3, 5, witnesses=witnesses, settled=True))
    assert tracker.registry.excluded == {}


def test_an_unsettled_verdict_is_an_event_only():
    tracker = _tracker()
    assert tracker.handle(p.Verdict("head", "tiny", "t1", 3, 5, witnesses=("t2",))).detail == "reported"
    status = tracker.status_body()
    assert not any(n["excluded"] for n in status["nodes"])
    assert [e["code"] for e in status["events"] if e["kind"] == "audit"] == ["audit_mismatch"]
