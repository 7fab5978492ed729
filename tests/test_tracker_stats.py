"""Stats hygiene, timing derivation, attribution; the console event ring."""
from __future__ import annotations

import pytest

from fabric.wire.protocol import Hop
from tracker.events import EventRing
from tracker.stats import (
    MIN_THROUGHPUT_TOKENS,
    Completion,
    StatsStore,
    attribute_hops,
    decode_timing,
    feeds_throughput,
    route_label,
)

ONE = (Hop("a", "tcp://a:1", 0, 29),)
TWO = (Hop("a", "tcp://a:1", 0, 14), Hop("b", "tcp://b:1", 15, 29))


def done(tokens: int, elapsed: float, route=ONE, reason: str | None = "stop", first=None) -> Completion:
    return Completion(model="m", route=route, completion_tokens=tokens, elapsed=elapsed,
                      finish_reason=reason, first_progress=first)


def test_short_completions_never_feed_throughput():
    assert MIN_THROUGHPUT_TOKENS == 8
    assert not feeds_throughput(7, "stop") and feeds_throughput(8, "stop")
    assert not feeds_throughput(100, "error")
    store = StatsStore()
    for tokens in range(0, 8):
        assert store.record(done(tokens, 0.001)) is False  # absurdly "fast" broken routes
    assert store.layer_rates() == {}
    assert store.snapshot()["routes"] == [] and store.snapshot()["decode_tps"] == []
    assert store.record(done(10, 1.0)) is True
    assert store.layer_rates() == {("a", "m"): pytest.approx(30 * 10 / 1.0)}
    assert store.counts == {"completions": 9, "fed": 1, "too_short": 8, "errors": 0}


def test_errored_completions_feed_nothing():
    store = StatsStore()
    assert store.record(done(50, 1.0, reason="error", first=(1, 0.2))) is False
    snap = store.snapshot()
    assert snap["ttft"] == [] and snap["layer_steps_per_s"] == [] and snap["counts"]["errors"] == 1


def test_decode_timing_excludes_prefill_when_progress_was_seen():
    # First progress: 2 tokens at 0.6 s; final: 12 tokens at 1.6 s -> 0.1 s/token, TTFT 0.5 s.
    timing = decode_timing(12, 1.6, (2, 0.6))
    assert timing.seconds_per_token == pytest.approx(0.1)
    assert timing.ttft == pytest.approx(0.5)
    plain = decode_timing(10, 2.0)
    assert plain.seconds_per_token == pytest.approx(0.2) and plain.ttft is None
    assert decode_timing(10, 2.0, (10, 2.0)).ttft is None  # no later observation: no split
    assert decode_timing(0, 1.0) is None and decode_timing(5, 0.0) is None


def test_attribution_and_route_records():
    assert attribute_hops([1.0, 3.0], 0.4) == pytest.approx([0.1, 0.3])
    assert attribute_hops([0.0, 0.0], 0.4) == pytest.approx([0.2, 0.2])
    assert attribute_hops([], 1.0) == []
    store = StatsStore(window=4)
    # 20 tokens in 2 s: 0.1 s/token, 0.02 s of it is links; hop b predicted 3x slower.
    assert store.record(done(20, 2.0, route=TWO), hop_weights=[1.0, 3.0], link_s=0.02,
                        predicted_s=0.05)
    rates = store.layer_rates()
    assert rates[("a", "m")] == pytest.approx(15 / 0.02)
    assert rates[("b", "m")] == pytest.approx(15 / 0.06)
    (route,) = store.snapshot()["routes"]
    assert route["route"] == route_label(TWO) == "a[0-14]>b[15-29]"
    assert route["predicted_tps"] == pytest.approx(20.0) and route["actual_tps"] == pytest.approx(10.0)
    hop_rows = {r["node"]: r["seconds"] for r in store.snapshot()["hop_latency"]}
    assert hop_rows == pytest.approx({"a": 0.02, "b": 0.06})


def test_rolling_window_uses_the_median_of_recent_samples():
    store = StatsStore(window=3)
    for elapsed in (1.0, 1.0, 1.0, 2.0, 2.0):
        store.record(done(10, elapsed))
    assert store.layer_rates()[("a", "m")] == pytest.approx(30 * 10 / 2.0)
    assert store.snapshot()["layer_steps_per_s"][0]["samples"] == 3
    store.forget_node("a")
    assert store.layer_rates() == {}


def test_ttft_is_kept_per_head_even_for_short_answers():
    store = StatsStore()
    store.record(done(3, 0.9, route=TWO, first=(1, 0.5)))
    assert store.snapshot()["ttft"] == [{"node": "a", "model": "m", "seconds": 0.5, "samples": 1}]
    assert store.layer_rates() == {}


def test_event_ring_updates_progress_in_place_and_is_bounded():
    clock = iter(range(1000)).__next__
    ring = EventRing(size=3, clock=clock)
    ring.add("route selected", "r", hops=[])
    first = ring.upsert("progress", "req1", "1 tokens", tokens=1)
    second = ring.upsert("progress", "req1", "5 tokens", tokens=5)
    assert second["id"] == first["id"] and second["seq"] > first["seq"]
    assert len(ring) == 2 and ring.recent()[-1]["tokens"] == 5
    assert [e["kind"] for e in ring.recent(since=first["seq"])] == ["progress"]
    for i in range(3):
        ring.add("complete", f"done {i}", key=f"r{i}")
    assert len(ring) == 3 and [e["message"] for e in ring.recent(limit=2)] == ["done 1", "done 2"]
    with pytest.raises(ValueError):
        ring.add("gossip", "nope")
