"""A hostile member against the tracker: absurd registrations, per-node state that must not
outlive the node, and reports that try to steer the planner's rates. Frames go over real
sockets where the point is the wire; state bounds are checked on the service itself."""
from __future__ import annotations

import pytest
import zmq

from fabric.wire.protocol import (
    MAX_HOPS,
    MAX_MODEL_LAYERS,
    Ack,
    AssignRequest,
    Error,
    Heartbeat,
    Hop,
    Leave,
    Report,
    RouteRequest,
    StatusRequest,
    encode,
)
from tests.support import FakeClock
from tests.test_tracker_service import Running, register
from tracker.ledger import Ledger
from tracker.reach import MAX_PENDING_CHECKS, ReachChecker
from tracker.keys import MAX_DEPARTED_KEYS
from tracker.service import Tracker, TrackerConfig
from tracker.stats import MAX_HEADS_PER_ROW, MAX_STAT_ROWS, Completion, StatsStore


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def tracker(tmp_path, context):
    """A tracker whose nodes never expire within a test: these tests send no heartbeats, and a
    loaded machine took longer than 3 x 0.2 s over 200 reports, so the nodes under test expired
    and took their statistics with them (expiry has its own test, on a fake clock)."""
    running = Running(tmp_path, context, heartbeat_interval=60.0)
    yield running
    running.stop()


# --------------------------------------------------------------------------- REGISTER bounds


def test_an_absurd_layer_count_is_refused_and_the_tracker_carries_on(tracker):
    peer = tracker.peer
    for layers in (4096, MAX_MODEL_LAYERS + 1):
        reply = peer.call(register("evil", 0, 0, num_layers=layers, fingerprint=f"x{layers}"))
        assert isinstance(reply, Error) and reply.code == "bad_request" and str(layers) in reply.message
    assert isinstance(peer.call(register("a", 0, 29)), Ack)
    assert [n["id"] for n in peer.status()["nodes"]] == ["a"]


def test_nodes_of_one_fingerprint_must_agree_on_the_layer_count(tracker):
    peer = tracker.peer
    assert isinstance(peer.call(register("a", 0, 14)), Ack)  # fingerprint "f": 30 layers
    reply = peer.call(register("evil", 0, 40, num_layers=64))
    assert isinstance(reply, Error) and reply.code == "bad_request"
    assert "64" in reply.message and "30" in reply.message  # both numbers named
    assert isinstance(peer.call(register("b", 15, 29)), Ack)  # agreeing nodes still join
    assert [h.node for h in peer.call(RouteRequest(model="m")).hops] == ["a", "b"]
    assert isinstance(peer.call(register("c", 0, 29, fingerprint="g", num_layers=30)), Ack)
    # once every node of the fingerprint is gone, the next registration sets the count again
    for node in ("a", "b"):
        assert isinstance(peer.call(Leave(node_id=node)), Ack)
    assert isinstance(peer.call(register("d", 0, 63, num_layers=64)), Ack)


@pytest.mark.parametrize("bad", [
    dict(hardware={f"k{i}": i for i in range(100)}),
    dict(hardware={"device": "x" * 5000}),
    dict(hardware={"device": {"nested": [1, 2, 3]}}),
    dict(benchmark=1e300),
    dict(start_layer=0, end_layer=30),
])
def test_oversized_registration_fields_are_refused(tracker, bad):
    reply = tracker.peer.call(register("evil", 0, 29, **bad))
    assert isinstance(reply, Error) and reply.code == "bad_request"
    assert tracker.peer.status()["nodes"] == []


# --------------------------------------------------------------------------- the wire's limits, at the tracker

_HOPS = tuple(Hop(f"h{i}", "tcp://127.0.0.1:1", i, i) for i in range(MAX_HOPS + 1))
LIMITS = {  # what a hostile peer sends -> a phrase of the tracker's ERROR (bad_request)
    "a route request for a 257-character model": (RouteRequest(model="m" * 257), "model must have 1-256"),
    "a route request around 65 nodes": (RouteRequest(model="m", exclude=tuple(f"n{i}" for i in range(65))),
                                        "exclude lists at most 64"),
    "a route request around a 257-character id": (RouteRequest(model="m", exclude=("n" * 257,)),
                                                  "an excluded node id must have 1-256"),
    "an assignment for a 257-character model": (AssignRequest(model="m" * 257, num_layers=30), "model must have"),
    "an assignment for 1025 layers": (AssignRequest(model="m", num_layers=MAX_MODEL_LAYERS + 1), "num_layers 1025"),
    "a report of 65 hops": (Report(request_id="r", node_id="a", model="m", route=_HOPS[:MAX_HOPS + 1]),
                            "at most 64 hops"),
    "a report billing a 257-character key": (Report(request_id="r", node_id="a", model="m", api_key="k" * 257),
                                             "api_key must have 1-256"),
    "a heartbeat with -1 sessions": (Heartbeat(node_id="a", sessions=-1), "sessions and queued must be >= 0"),
}


@pytest.mark.parametrize("case", list(LIMITS))
def test_a_message_past_a_limit_is_refused_by_name_and_the_tracker_carries_on(tracker, case):
    message, phrase = LIMITS[case]
    peer = tracker.peer
    assert isinstance(peer.call(register("a", 0, 29)), Ack)
    reply = peer.call(message)
    assert isinstance(reply, Error) and reply.code == "bad_request" and phrase in reply.message, reply
    assert [h.node for h in peer.call(RouteRequest(model="m")).hops] == ["a"]  # and it still serves
    assert len(peer.status()["nodes"]) == 1


# --------------------------------------------------------------------------- per-node state is pruned


@pytest.fixture
def secured(tmp_path):
    """A secured tracker served by hand (``call``), with a ledger, expiring on ``clock``."""
    from fabric.net.security import create_keys, load

    create_keys(tmp_path / "swarm", "swarm", tracker=True)
    config = TrackerConfig(db=":memory:", security=load(tmp_path / "swarm"), heartbeat_interval=1.0,
                           reach_timeout=0)
    clock = FakeClock()
    tracker = Tracker(config, clock=clock)
    with Ledger(":memory:") as ledger:
        tracker._ledger = ledger
        yield tracker, clock


def call(tracker: Tracker, message, key: str):
    """What the tracker answers ``message`` sent with CURVE key ``key`` (as ``_drain`` does)."""
    return tracker.respond([b"peer-identity", *encode(message)], key)[1]


def test_key_bindings_and_stats_go_when_nodes_expire_or_leave(secured):
    tracker, clock = secured
    for i in range(MAX_DEPARTED_KEYS + 500):  # a member cycles through node ids: each registers, reports, goes
        assert isinstance(call(tracker, register(f"n{i}", 0, 29), "k" * 40), Ack)
        assert isinstance(call(tracker, _final(f"r{i}", f"n{i}", FULL(f"n{i}"), 20, 2.0), "k" * 40), Ack)
        if i % 2:
            assert call(tracker, Leave(node_id=f"n{i}"), "k" * 40) == Ack(detail="left")
    assert tracker.stats.rows() > 0
    clock.now += 10.0
    call(tracker, register("last", 0, 29), "k" * 40)  # the others expire meanwhile
    assert set(tracker.keys.nodes) == {"last"}
    assert len(tracker.keys.departed) == MAX_DEPARTED_KEYS
    assert tracker.stats.rows() == 0 and tracker.stats.layer_rates() == {}


def test_refused_registrations_bind_no_id(secured):
    tracker, _ = secured
    for i in range(500):
        reply = call(tracker, register(f"n{i}", 0, 29, num_layers=4096), "E" * 40)
        assert isinstance(reply, Error) and reply.code == "bad_request"
    assert tracker.keys.nodes == {} and not tracker.keys.departed
    assert isinstance(call(tracker, register("n1", 0, 29), "H" * 40), Ack)  # the id is free for its real node


def test_a_departed_id_stays_with_its_key_for_a_while(secured):
    tracker, _ = secured
    assert isinstance(call(tracker, register("a", 0, 29), "A" * 40), Ack)
    assert call(tracker, Leave(node_id="a"), "A" * 40) == Ack(detail="left")
    reply = call(tracker, register("a", 0, 29), "B" * 40)
    assert isinstance(reply, Error) and "belongs to another key" in reply.message
    assert isinstance(call(tracker, register("a", 0, 29), "A" * 40), Ack)


def test_weights_differ_warnings_are_kept_for_live_fingerprints_only(secured):
    tracker, _ = secured
    call(tracker, register("a", 0, 14, fingerprint="f0"), "A" * 40)
    for i in range(300):  # one member re-registers under ever new fingerprints
        assert isinstance(call(tracker, register("b", 15, 29, fingerprint=f"f{i + 1}"), "B" * 40), Ack)
        assert "weights_differ" in call(tracker, StatusRequest(), "B" * 40).body  # plans published, warnings logged
    assert len(tracker._differ_warned) == 1


def test_reachability_checks_are_deduplicated_and_bounded(context):
    checker = ReachChecker(context, None, timeout=5.0)
    try:
        closed = "tcp://127.0.0.1:9"  # discard port: nobody answers a PING there
        assert checker.check("a", closed) is True
        assert not any(checker.check("a", closed) for _ in range(100))  # a member re-registering in a loop
        queued = sum(checker.check(f"n{i}", closed) for i in range(MAX_PENDING_CHECKS + 200))
        assert queued <= MAX_PENDING_CHECKS - 1 and checker.pending() <= MAX_PENDING_CHECKS
    finally:
        checker.close()


# --------------------------------------------------------------------------- statistics poisoning


def _final(rid: str, head: str, route: tuple[Hop, ...], tokens: int, elapsed: float) -> Report:
    return Report(request_id=rid, node_id=head, model="m", route=route, prompt_tokens=7, completion_tokens=tokens,
                  elapsed=elapsed, final=True, finish_reason="stop", api_key="sk-test", max_tokens=64)


FULL = lambda node: (Hop(node, f"tcp://{node}:1", 0, 29),)  # noqa: E731


def test_reports_about_unknown_nodes_or_from_unknown_heads_create_no_rows(tracker):
    peer = tracker.peer
    peer.call(register("a", 0, 29))
    peer.call(register("x", 0, 29, model="other", fingerprint="o"))
    forged = [
        _final("r1", "a", FULL("ghost"), 20, 2.0),  # a hop no node registered
        _final("r2", "stranger", FULL("a"), 20, 2.0),  # a head that never registered
        _final("r3", "x", FULL("a"), 20, 2.0),  # a head serving another model
        _final("r4", "a", (Hop("a", "tcp://a:1", 0, 9),), 20, 2.0),  # a route that stops at layer 9
        _final("r5", "a", (Hop("a", "tcp://a:1", 0, 14), Hop("x", "tcp://x:1", 15, 29)), 20, 2.0),  # other model
    ]
    for msg in forged:
        assert isinstance(peer.call(msg), Ack)  # billed or held as before: only statistics refuse
    stats = peer.status()["stats"]
    assert stats["layer_steps_per_s"] == [] and stats["hop_latency"] == [] and stats["routes"] == []
    assert stats["refused"] == len(forged)
    assert isinstance(peer.call(_final("ok", "a", FULL("a"), 20, 2.0)), Ack)  # an honest report still counts
    assert [r["node"] for r in peer.status()["stats"]["layer_steps_per_s"]] == ["a"]


def test_one_head_flooding_reports_cannot_steer_the_plan(tracker):
    """Three honest heads measured 'slow' at about 10 layer-steps/s and 'fast' at about 15;
    a fourth head sends 200 reports that 'slow' is 10,000x faster. The plan stays on 'fast'."""
    peer = tracker.peer
    for name in ("slow", "fast", "h1", "h2", "h3", "evil"):
        peer.call(register(name, 0, 29, bench=100.0))
    for i, (head, seconds) in enumerate((("h1", 3.0), ("h2", 3.1), ("h3", 2.9))):
        peer.call(_final(f"s{i}", head, FULL("slow"), 10, seconds * 10))  # 30 layers / 3 s per token
        peer.call(_final(f"f{i}", head, FULL("fast"), 10, seconds * 10 / 1.5))
    assert [h.node for h in peer.call(RouteRequest(model="m", exclude=("h1", "h2", "h3", "evil"))).hops] == ["fast"]
    for i in range(200):
        peer.call(_final(f"e{i}", "evil", FULL("slow"), 10, 0.0003))
    rates = {r["node"]: r["layer_steps_per_s"] for r in peer.status()["stats"]["layer_steps_per_s"]}
    assert 9.0 < rates["slow"] < 11.0
    assert [h.node for h in peer.call(RouteRequest(model="m", exclude=("h1", "h2", "h3", "evil"))).hops] == ["fast"]


def test_one_key_is_one_vote_however_many_node_ids_it_registers(secured):
    tracker, _ = secured
    call(tracker, register("slow", 0, 29), "S" * 40)
    for head, key in (("h1", "1" * 40), ("h2", "2" * 40), ("h3", "3" * 40)):
        call(tracker, register(head, 0, 29), key)
        assert isinstance(call(tracker, _final(f"r-{head}", head, FULL("slow"), 10, 30.0), key), Ack)
    for i in range(6):  # one member, six node ids, all under its one key
        call(tracker, register(f"sock{i}", 0, 29), "E" * 40)
        assert isinstance(call(tracker, _final(f"e{i}", f"sock{i}", FULL("slow"), 10, 0.0003), "E" * 40), Ack)
    assert tracker.stats.layer_rates()[("slow", "m")] == pytest.approx(10.0)


def test_stat_rows_and_heads_per_row_are_bounded():
    store = StatsStore(window=4)
    for i in range(MAX_STAT_ROWS + 50):
        store.record(Completion("m", FULL(f"n{i}"), 10, 1.0, "stop"), head="h")
    assert len(store.layer_rates()) == MAX_STAT_ROWS and store.rows() <= 4 * MAX_STAT_ROWS
    for i in range(MAX_HEADS_PER_ROW + 20):
        store.record(Completion("m", FULL("a"), 10, 1.0, "stop"), head=f"h{i}")
    assert len(store._layer_rate[("a", "m")].heads) == MAX_HEADS_PER_ROW


def test_in_plaintext_only_the_heads_own_connection_may_audit_in_its_name(tracker, context):
    """A stranger's DEALER sends REPLICAS_REQUEST and a settled VERDICT under a registered head's
    id, citing the replicas it was told of: refused, and nobody is excluded. The head's own
    connection (the one that registered it) is answered."""
    from fabric.wire.protocol import Replicas, ReplicasRequest, Verdict
    from tests.test_tracker_service import Peer

    head = tracker.peer
    for node_id, start, end in (("head", 0, 14), ("suspect", 15, 29), ("r1", 15, 29), ("r2", 15, 29)):
        assert isinstance(head.call(register(node_id, start, end)), Ack)
    rogue = Peer(context, tracker.tracker.endpoint)
    ask = ReplicasRequest("a1", "m", "f", 15, 29, exclude=("head", "suspect"), node_id="head", suspect="suspect")
    verdict = Verdict("head", "m", "suspect", 15, 29, witnesses=("r1", "r2"), settled=True)
    for message in (ask, verdict):
        reply = rogue.call(message)
        assert isinstance(reply, Error) and "not registered on this connection" in reply.message
    assert isinstance(head.call(ask), Replicas)  # the head itself asks, as its auditor does
    assert all(not n["excluded"] for n in head.status()["nodes"])


def test_a_report_whose_time_a_token_rounds_to_zero_feeds_nothing_and_is_answered(tracker):
    """A finite elapsed so small that elapsed / tokens is 0.0 (a subnormal float): the rate would be
    its reciprocal. The report is billed as any other, the statistics take nothing from it, and an
    honest report still counts."""
    peer = tracker.peer
    peer.call(register("a", 0, 29))
    assert isinstance(peer.call(_final("tiny", "a", FULL("a"), 20, 5e-324)), Ack)  # 5e-324 s / 20 tokens == 0.0
    stats = peer.status()["stats"]
    assert stats["layer_steps_per_s"] == [] and stats["routes"] == [] and stats["counts"]["too_short"] == 1, stats
    assert isinstance(peer.call(_final("ok", "a", FULL("a"), 20, 2.0)), Ack)
    assert [r["node"] for r in peer.status()["stats"]["layer_steps_per_s"]] == ["a"]
