"""Audits without sockets: the comparison and the majority (verdicts), the head's auditor as
a state machine over a recording host, the hop's taps and replays on a real shard, and the
tracker's replicas and verdicts."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from fabric.compute.compute_lock import ComputeLock
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.node.audit import AuditConfig, Auditor
from fabric.node.scheduler import HopScheduler, SchedulerConfig, Work
from fabric.node.hops import HopRunner
from fabric.node.taps import Taps, kernels
from fabric.node.verdicts import Claim, Outcome, agree, distance, judge
from fabric.wire import protocol as p
from fabric.wire.shard import Shard

K = "torch 2 cpu AVX2 threads 1"  # one exact-mode arithmetic
HEAD = p.Hop("head", "tcp://head", 0, 2)
TAIL = p.Hop("tail", "tcp://tail", 3, 5)
R1, R2, R3 = (p.Hop(f"r{i}", f"tcp://r{i}", 3, 5) for i in (1, 2, 3))


def hidden(seed: int = 0, size: int = 8) -> torch.Tensor:
    return torch.randn(1, 3, size, generator=torch.Generator().manual_seed(seed))  # (1, q, hidden)


# --------------------------------------------------------------------------- verdicts


def test_same_exact_kernels_must_be_bit_equal():
    x = hidden()
    nudged = x.clone()
    nudged[0, 0, 0] = torch.nextafter(x[0, 0, 0], torch.tensor(math.inf))  # one ulp
    assert agree(Claim("a", x, K), Claim("b", x.clone(), K))
    assert not agree(Claim("a", x, K), Claim("b", nudged, K))
    # other kernels, or no exact mode: rounding passes within the tolerance
    assert agree(Claim("a", x, K), Claim("b", nudged, K + " avx512"))
    assert agree(Claim("a", x, ""), Claim("b", nudged, ""))
    assert agree(Claim("a", x.bfloat16(), K), Claim("b", nudged.bfloat16(), K))  # exact mode is float32 only


def test_the_tolerance_is_a_relative_distance():
    x = hidden()
    assert distance(x, x) == 0.0
    assert distance(x * 1.01, x) == pytest.approx(0.01, rel=1e-6)
    assert agree(Claim("a", x * 1.01, ""), Claim("b", x, ""), tolerance=0.02)
    assert not agree(Claim("a", x * 1.05, ""), Claim("b", x, ""), tolerance=0.02)
    assert not agree(Claim("a", x.flip(-1), ""), Claim("b", x, ""), tolerance=0.02)


@pytest.mark.parametrize("other", [torch.full((1, 3, 8), math.nan), torch.zeros(1, 3, 9), torch.zeros(24)])
def test_not_finite_or_another_shape_never_agrees(other):
    x = hidden()
    assert distance(other, x) == math.inf
    assert not agree(Claim("a", other, ""), Claim("b", x, ""), tolerance=1e9)


def test_an_inconsistent_claim_agrees_with_nothing():
    x = hidden()
    assert not agree(Claim("a", x, K, consistent=False), Claim("b", x, K))


def _claims(*tensors):
    return [Claim(n, t, K) for n, t in zip(("s", "r1", "r2"), tensors)]


@pytest.mark.parametrize("outputs,more,outcome,liar,witnesses", [
    ((0,), True, Outcome.ASK, "", ()),
    ((0, 0), False, Outcome.PASS, "", ()),
    ((1, 0), True, Outcome.ASK, "", ("r1",)),
    ((1, 0), False, Outcome.UNSETTLED, "", ("r1",)),
    ((1, 0, 0), False, Outcome.LIAR, "s", ("r1", "r2")),  # the suspect lied
    ((0, 1, 0), False, Outcome.LIAR, "r1", ("s", "r2")),  # the first replica lied
    ((0, 1, 2), False, Outcome.UNSETTLED, "", ("r1", "r2")),  # three different outputs
])
def test_judge(outputs, more, outcome, liar, witnesses):
    suspect, *replicas = _claims(*(hidden(seed) for seed in outputs))
    verdict = judge(suspect, replicas, more)
    assert (verdict.outcome, verdict.liar, verdict.witnesses) == (outcome, liar, witnesses)


# --------------------------------------------------------------------------- the head's auditor


class Host:
    """The node as the auditor sees it, recording what goes out."""

    endpoint, key = "tcp://head", ""

    def __init__(self):
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
    def __init__(self, rate: float = 1.0, route: tuple[p.Hop, ...] = (HEAD, TAIL)):
        self.host, self.released, self.around = Host(), [], []
        self.counters = Counter()
        self.auditor = Auditor(AuditConfig(audit_rate=rate, audit_timeout=10.0), self.host, "head", "tiny", "fp",
                               self.counters, self.released.append, self.around.append, rng=random.Random(0))
        self.route = route

    def send(self, pos: int = 0, reuse: str = "", step: int = 0, draw: bool = True) -> p.Forward:
        if step == 0 and draw:
            self.auditor.draw("s")  # the head draws each new request
        msg = p.Forward(session="s", step=step, pos=pos, start_layer=0, end_layer=2, route=self.route[1:],
                        reply_to="tcp://head", reuse=reuse)
        self.auditor.forward(self.route[0], msg, torch.zeros(1, 3, dtype=torch.int64))
        return self.host.forwarded[-1]

    def tap(self, output: torch.Tensor, node: str = "tail", kernels: str = K, step: int = 0, more: bool = False):
        tap = p.AuditTap("s", step, node, 3, 5, kernels=kernels, more=more)
        self.auditor.received(tap, [hidden(99), output])

    def replicas(self, *hops: p.Hop):
        ask = self.host.tracker[-1]
        assert isinstance(ask, p.ReplicasRequest) and ask.exclude == ("head", "tail")
        self.auditor.replicas(p.Replicas(ask.audit, hops))

    def answer(self, node: str, output: torch.Tensor | None, kernels: str = K):
        audit = self.host.sent[-1][1].audit
        self.auditor.received(p.AuditResult(audit, node, kernels=kernels, error="" if output is not None else "no"),
                              [] if output is None else [output])

    def token(self, token: int = 7, step: int = 0) -> bool:
        return self.auditor.hold(p.Token("s", step, token, 3))

    @property
    def asked(self) -> list[str]:
        return [endpoint for endpoint, msg, _ in self.host.sent if isinstance(msg, p.Audit)]

    @property
    def verdicts(self) -> list[p.Verdict]:
        return [m for m in self.host.tracker if isinstance(m, p.Verdict)]


def test_only_prefills_past_the_head_are_audited():
    rig = Rig()
    assert rig.send().audit == TAIL.start_layer
    assert rig.send(pos=5, step=1).audit == -1  # a decode step needs a past KV no replica holds
    assert rig.send(pos=5, reuse="old", step=2).audit == -1  # a step from kept KV, likewise
    assert Rig(route=(HEAD,)).send().audit == -1  # nothing but the head itself
    assert Rig(rate=0.0).send().audit == -1
    assert Rig().send(draw=False).audit == -1  # a request the head did not draw (it may start from kept KV)
    assert rig.send(step=3).audit == TAIL.start_layer  # a re-prefill: drawn again, at the rate


def test_the_rate_is_the_share_of_prefills_audited_and_the_hop_is_drawn():
    mid = p.Hop("mid", "tcp://mid", 3, 4)
    rig = Rig(rate=0.25, route=(HEAD, mid, p.Hop("tail", "tcp://tail", 5, 5)))
    marks = [rig.send(step=i).audit for i in range(4000)]
    assert 0.22 < sum(m != -1 for m in marks) / 4000 < 0.28
    assert {m for m in marks if m != -1} == {3, 5}


def test_a_passing_audit_holds_the_token_until_the_replica_agrees():
    rig = Rig()
    rig.send()
    rig.tap(hidden(1))
    assert rig.token()  # held
    rig.replicas(R1, R2)
    assert rig.asked == ["tcp://r1"] and torch.equal(rig.host.sent[-1][2][0], hidden(99))  # the suspect's input
    assert rig.released == []
    rig.answer("r1", hidden(1).clone())
    assert [t.token for t in rig.released] == [7] and rig.verdicts == [] and rig.around == []
    assert rig.counters["audits_passed"] == 1
    assert not rig.token()  # the audit is over: tokens pass


def test_a_suspect_two_replicas_contradict_is_convicted_and_its_token_dropped():
    rig = Rig()
    rig.send()
    rig.token()
    rig.tap(hidden(1).flip(-1))
    rig.replicas(R1, R2, R3)
    rig.answer("r1", hidden(1))
    assert rig.asked == ["tcp://r1", "tcp://r2"]
    rig.answer("r2", hidden(1))
    (verdict,) = rig.verdicts
    assert (verdict.suspect, verdict.witnesses, verdict.settled) == ("tail", ("r1", "r2"), True)
    assert rig.around == ["tail"] and rig.released == [] and rig.auditor.convicted == {"tail"}
    assert rig.counters["audits_convicted"] == 1


def test_a_lying_replica_is_convicted_and_the_token_goes_on():
    rig = Rig()
    rig.send()
    rig.token()
    rig.tap(hidden(1))
    rig.replicas(R1, R2)
    rig.answer("r1", hidden(2))
    rig.answer("r2", hidden(1))
    (verdict,) = rig.verdicts
    assert (verdict.suspect, verdict.witnesses) == ("r1", ("tail", "r2"))
    assert rig.around == ["r1"] and len(rig.released) == 1


def test_with_one_replica_a_mismatch_is_reported_and_nobody_excluded():
    rig = Rig()
    rig.send()
    rig.token()
    rig.tap(hidden(1))
    rig.replicas(R1)
    rig.answer("r1", hidden(2))
    (verdict,) = rig.verdicts
    assert (verdict.suspect, verdict.settled, verdict.witnesses) == ("tail", False, ("r1",))
    assert rig.around == [] and len(rig.released) == 1 and rig.counters["audits_unsettled"] == 1


def test_a_replica_that_cannot_compute_is_passed_over():
    rig = Rig()
    rig.send()
    rig.token()
    rig.tap(hidden(1))
    rig.replicas(R1, R2)
    rig.answer("r1", None)
    assert rig.asked == ["tcp://r1", "tcp://r2"]
    rig.answer("r2", hidden(1))
    assert len(rig.released) == 1 and rig.counters["audits_passed"] == 1


def test_the_tails_token_must_follow_from_its_own_logits():
    logits = torch.linspace(-1, 1, 320)  # greedy: token 319
    rig = Rig()
    rig.send()
    rig.tap(logits)
    rig.replicas(R1, R2)
    rig.answer("r1", logits.clone())
    assert rig.released == [] and rig.asked == ["tcp://r1"]  # the tail's claim waits for its token
    rig.token(token=5)  # honest logits, another token sent
    rig.answer("r2", logits.clone())
    assert rig.verdicts[0].suspect == "tail" and rig.released == []

    honest = Rig()
    honest.send()
    honest.tap(logits)
    honest.replicas(R1)
    honest.answer("r1", logits.clone())
    honest.token(token=319)
    assert len(honest.released) == 1 and honest.verdicts == []


def test_a_tapped_prefill_chunk_is_compared_without_the_token():
    logits = torch.linspace(-1, 1, 320)
    rig = Rig()
    rig.send()
    rig.tap(logits, more=True)  # the first slice of a long prompt: its logits are not the token's
    rig.replicas(R1)
    rig.answer("r1", logits.clone())
    assert rig.counters["audits_passed"] == 1 and not rig.token(token=5)


@pytest.mark.parametrize("how", ["no tracker", "no replica", "timeout", "stale tap"])
def test_an_audit_that_cannot_finish_lets_the_token_go(how):
    rig = Rig()
    rig.send()
    rig.token()
    if how == "no tracker":
        rig.host.has_tracker = False
        rig.tap(hidden(1))
    elif how == "no replica":
        rig.tap(hidden(1))
        rig.replicas()
    else:
        if how == "stale tap":
            rig.tap(hidden(1), node="other")
            rig.tap(hidden(1), step=3)
            assert rig.released == []
        rig.auditor.tick(float("inf"))
    assert len(rig.released) == 1 and rig.counters["audits_skipped"] == 1 and rig.verdicts == []


def test_a_mismatch_still_open_at_the_timeout_is_reported():
    rig = Rig()
    rig.send()
    rig.token()
    rig.tap(hidden(1))
    rig.replicas(R1, R2)
    rig.answer("r1", hidden(2))
    rig.auditor.tick(float("inf"))  # r2 never answered
    assert rig.verdicts[0].settled is False and len(rig.released) == 1


def test_an_ended_session_forgets_its_audits():
    rig = Rig()
    rig.send()
    rig.auditor.forget("s")
    assert not rig.token() and rig.auditor.pending == {}


# --------------------------------------------------------------------------- the hop's side


@pytest.fixture(scope="module")
def tail(tiny_models) -> ShardExecutor:
    return ShardExecutor(load_shard(resolve(str(tiny_models("llama"))), Shard(3, 5, 6), progress=False), KVStore())


def _forward(audit: int, pos: int = 0, more: bool = False, start: int = 3, end: int = 5) -> p.Forward:
    return p.Forward(session="s", step=0, pos=pos, start_layer=start, end_layer=end, route=(), reply_to="tcp://head",
                     audit=audit, more=more)


def test_a_replica_reruns_a_tapped_hop_bit_for_bit(tail):
    taps = Taps(tail, ComputeLock(None), "tail", kernels("cpu", torch.float32, None), Counter())
    x = hidden(size=64)  # (1, q, hidden) of the tiny model
    work = Work(_forward(3), x)
    result = tail.run("s", 3, 5, x, 0)  # the hop, as the node runs a tapped step: alone
    tap, (inputs, output) = taps.tap(work, result)
    assert (tap.session, tap.node, tap.kernels) == ("s", "tail", taps.kernels) and inputs is x
    assert output.shape == (320,)  # the tail's logits
    answer, (replayed,) = taps.replay(p.Audit("a1", 3, 5, "tcp://head"), inputs)
    assert answer.error == "" and torch.equal(replayed, output)
    assert "audit:a1" not in tail.kv  # the replica's session is gone


def test_a_tapped_chunk_on_the_tail_is_run_with_its_logits_and_a_replay_it_cannot_run_is_an_error(tail):
    lock = ComputeLock(None)
    taps = Taps(tail, lock, "tail", "", Counter())
    x = hidden(size=64)
    (result,), _, _ = HopRunner(tail, lock, Counter()).run([Work(_forward(3, more=True), x)])
    tap, (_, output) = taps.tap(Work(_forward(3, more=True), x), result)
    assert tap.more and output.shape == (320,)  # the chunk's last position: a replica computes the same
    assert torch.equal(taps.replay(p.Audit("a3", 3, 5, "tcp://head"), x)[1][0], output)
    (plain,), _, _ = HopRunner(tail, lock, Counter()).run([Work(_forward(-1, more=True), x)])
    assert plain.logits is None  # an untapped chunk skips the tail's norm and lm_head
    answer, tensors = taps.replay(p.Audit("a2", 1, 5, "tcp://head"), x)
    assert "outside this node's shard" in answer.error and tensors == []


def test_kernels_name_exact_mode_only():
    assert kernels("cpu", torch.float32, None).startswith(f"torch {torch.__version__} cpu ")
    assert kernels("cpu", torch.bfloat16, None) == kernels("cpu", torch.float32, "int8") == ""
    assert kernels("cuda", torch.float32, None) == ""


def test_a_tapped_prompt_runs_alone():
    sched = HopScheduler(SchedulerConfig(), live=set())
    for session, audit in (("a", -1), ("b", 3), ("c", -1)):
        sched.push(Work(p.Forward(session=session, step=0, pos=0, start_layer=3, end_layer=5, route=(),
                                  reply_to="h", audit=audit), torch.zeros(1, 4, 8)))
    assert [[w.session for w in sched.next_batch()] for _ in range(2)] == [["a", "c"], ["b"]]
    assert Work(_forward(3, pos=4), hidden()).tapped is False  # only a step at position 0 is tapped
    assert Work(_forward(4), hidden()).tapped is False  # another hop is audited


# --------------------------------------------------------------------------- the tracker's side


def _tracker():
    from tracker.service import Tracker, TrackerConfig

    tracker = Tracker(TrackerConfig(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*", db=":memory:"))
    for node, start, end, fp in (("head", 0, 2, "fp"), ("t1", 3, 5, "fp"), ("t2", 3, 5, "fp"), ("full", 0, 5, "fp"),
                                 ("other", 3, 5, "fp2"), ("liar", 3, 5, "fp")):
        tracker.handle(p.Register(node_id=node, endpoint=f"tcp://{node}", model="tiny", fingerprint=fp,
                                  num_layers=6, start_layer=start, end_layer=end))
    tracker.handle(p.Heartbeat("t1", sessions=3))
    return tracker


def test_the_tracker_names_replicas_of_the_same_weights_least_loaded_first():
    tracker = _tracker()
    answer = tracker.handle(p.ReplicasRequest("a1", "tiny", "fp", 3, 5, exclude=("liar", "head")))
    assert answer.audit == "a1" and [h.node for h in answer.hops] == ["full", "t2", "t1"]
    assert {(h.start_layer, h.end_layer) for h in answer.hops} == {(3, 5)}
    assert tracker.handle(p.ReplicasRequest("a2", "tiny", "fp", 1, 5)).hops[0].node == "full"


def test_a_settled_verdict_excludes_the_liar_from_plans_replicas_and_routes():
    tracker = _tracker()
    verdict = p.Verdict("head", "tiny", "liar", 3, 5, witnesses=("t1", "t2"), settled=True, detail="1.04")
    assert tracker.handle(verdict).detail == "excluded"
    assert tracker.handle(verdict).detail == "already excluded"
    status = tracker.status_body()
    rows = {n["id"]: n for n in status["nodes"]}
    assert "wrong results" in rows["liar"]["excluded"] and rows["t1"]["excluded"] == ""
    from fabric.cli import format_status

    shown = {line.split()[0]: line for line in format_status(status).splitlines() if line[:1].isalnum()}
    assert "EXCLUDED" in shown["liar"] and "EXCLUDED" not in shown["t1"]  # what `meshnet status` prints
    assert all(h["node"] != "liar" for route in status["plans"]["tiny"] for h in route["hops"])
    assert "liar" not in {h.node for h in tracker.handle(p.ReplicasRequest("a3", "tiny", "fp", 3, 5)).hops}
    with pytest.raises(p.ProtocolError, match="no route for"):  # the liar is no way round them
        tracker.handle(p.RouteRequest("tiny", exclude=("full", "t1", "t2")))
    (event,) = [e for e in status["events"] if e["kind"] == "audit"]
    assert (event["node"], event["code"], event["by"], event["witnesses"]) == ("liar", "liar", "head", ["t1", "t2"])


def test_an_unsettled_verdict_is_an_event_only_and_strangers_are_refused():
    tracker = _tracker()
    assert tracker.handle(p.Verdict("head", "tiny", "t1", 3, 5, witnesses=("t2",))).detail == "reported"
    status = tracker.status_body()
    assert not any(n["excluded"] for n in status["nodes"])
    assert [e["code"] for e in status["events"] if e["kind"] == "audit"] == ["audit_mismatch"]
    with pytest.raises(p.ProtocolError, match="not registered"):
        tracker.handle(p.Verdict("stranger", "tiny", "t1", 3, 5, witnesses=("t2", "full"), settled=True))


def test_a_tapped_prompt_does_not_ride_decode_steps_and_still_gets_its_turn():
    sched = HopScheduler(SchedulerConfig(), live=set())
    for session, pos, audit in (("d", 9, -1), ("t", 0, 3)):
        sched.push(Work(p.Forward(session=session, step=0, pos=pos, start_layer=3, end_layer=5, route=(),
                                  reply_to="h", audit=audit), torch.zeros(1, 1 if pos else 4, 8)))
    sched.ran_prefill = True  # a prompt just ran: decode steps go next, and an untapped prompt would ride them
    assert [w.session for w in sched.next_batch()] == ["d"]  # the tapped prompt rides nothing
    sched.push(Work(p.Forward(session="d", step=1, pos=10, start_layer=3, end_layer=5, route=(), reply_to="h"),
                    torch.zeros(1, 1, 8)))
    assert [w.session for w in sched.next_batch()] == ["t"]  # and takes its turn between decode batches
