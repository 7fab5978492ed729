"""Route planner fixtures: each test is one registry snapshot and what must come out."""
from __future__ import annotations

import itertools
import random

import pytest

from fabric.wire.protocol import Hop
from tracker.node_records import NodeInfo
from tracker.planner import (
    CostModel,
    assign_span,
    coverage_gaps,
    estimate_route,
    link_between,
    plan_all,
    plan_routes,
    route_link_seconds,
)

NO_LINK = CostModel(link_cost_s=0.0)


def node(node_id: str, start: int, end: int, bench: float = 100.0, *, model: str = "m",
         fp: str = "f1", layers: int = 40, sessions: int = 0, max_sessions: int = 0,
         queued: int = 0) -> NodeInfo:
    return NodeInfo(node_id=node_id, endpoint=f"tcp://{node_id}:7000", model=model,
                    fingerprint=fp, num_layers=layers, start_layer=start, end_layer=end,
                    benchmark=bench, max_sessions=max_sessions, sessions=sessions, queued=queued)


def spans(route) -> list[tuple[str, int, int]]:
    return [(h.node, h.start_layer, h.end_layer) for h in route.hops]


def assert_valid(plan, nodes, num_layers: int) -> None:
    """Every route: contiguous from 0 to L-1, inside each node's shard, one fingerprint."""
    by_id = {n.node_id: n for n in nodes}
    for route in plan.routes:
        expected = 0
        for hop in route.hops:
            n = by_id[hop.node]
            assert hop.start_layer == expected, spans(route)
            assert n.start_layer <= hop.start_layer <= hop.end_layer <= n.end_layer
            assert n.fingerprint == route.fingerprint and n.model == plan.model
            assert hop.endpoint == n.endpoint
            expected = hop.end_layer + 1
        assert expected == num_layers
        names = [h.node for h in route.hops]
        assert len(names) == len(set(names)), "a node appears at most once per route"
    assert len({tuple(r.hops) for r in plan.routes}) == len(plan.routes), "routes are distinct"


def test_adr0020_partial_fast_head_then_full_slow_node_continues_at_22():
    nodes = [node("gpu", 0, 21, 11164.0), node("cpu", 0, 39, 425.0)]
    plan = plan_routes(nodes, "m")
    assert_valid(plan, nodes, 40)
    assert spans(plan.best) == [("gpu", 0, 21), ("cpu", 22, 39)]
    assert [spans(r) for r in plan.routes[1:]] == [[("cpu", 0, 39)]]
    for route in plan.routes:
        assert all(h.start_layer != 0 for h in route.hops[1:]), "never a second hop at layer 0"


def test_adr0020_full_node_alone_when_the_pipeline_wins_nothing():
    # The head is barely faster, so the hand-off costs more than it saves.
    nodes = [node("gpu", 0, 21, 440.0), node("cpu", 0, 39, 425.0)]
    plan = plan_routes(nodes, "m", cost=CostModel(link_cost_s=0.01))
    assert spans(plan.best) == [("cpu", 0, 39)]
    assert_valid(plan, nodes, 40)


def test_disjoint_shards_chain_in_order():
    nodes = [node("b", 15, 29, layers=30), node("a", 0, 14, layers=30)]
    plan = plan_routes(nodes, "m")
    assert [spans(r) for r in plan.routes] == [[("a", 0, 14), ("b", 15, 29)]]
    assert plan.gaps == ()


def test_overlapping_replicas_rank_the_faster_replica_first():
    nodes = [node("a", 0, 19, 100.0), node("b", 0, 19, 400.0), node("c", 20, 39, 200.0)]
    plan = plan_routes(nodes, "m")
    assert_valid(plan, nodes, 40)
    assert [spans(r) for r in plan.routes] == [
        [("b", 0, 19), ("c", 20, 39)], [("a", 0, 19), ("c", 20, 39)]]


@pytest.mark.parametrize("b_bench, expected", [
    (1000.0, [("a", 0, 13), ("b", 14, 39)]),  # b is fast: hand over as early as b can take it
    (50.0, [("a", 0, 29), ("b", 30, 39)]),  # b is slow: keep a as long as it can go
])
def test_overlap_switch_point_follows_speed(b_bench, expected):
    nodes = [node("a", 0, 29, 100.0), node("b", 14, 39, b_bench)]
    plan = plan_routes(nodes, "m", cost=NO_LINK)
    assert spans(plan.best) == expected
    assert_valid(plan, nodes, 40)


def test_coverage_gap_is_reported():
    nodes = [node("a", 0, 14, layers=30), node("b", 20, 29, layers=30)]
    plan = plan_routes(nodes, "m")
    assert plan.routes == ()
    assert plan.gaps == ((15, 19),)
    assert "15-19" in plan.describe_missing()


def test_excluded_nodes_are_routed_around():
    nodes = [node("full", 0, 39, 500.0), node("h", 0, 19), node("t", 20, 39)]
    assert spans(plan_routes(nodes, "m").best) == [("full", 0, 39)]
    plan = plan_routes(nodes, "m", exclude=["full"])
    assert [spans(r) for r in plan.routes] == [[("h", 0, 19), ("t", 20, 39)]]
    plan = plan_routes(nodes, "m", exclude=("full", "t"))
    assert plan.routes == () and plan.gaps == ((20, 39),)
    assert ("t", "excluded") in plan.skipped and "excluded" in plan.describe_missing()


def test_loaded_node_loses_to_an_idle_twin_and_full_nodes_are_skipped():
    nodes = [node("busy", 0, 39, sessions=3, queued=2), node("idle", 0, 39)]
    plan = plan_routes(nodes, "m")
    assert [spans(r) for r in plan.routes] == [[("idle", 0, 39)], [("busy", 0, 39)]]
    assert plan.routes[0].seconds_per_token < plan.routes[1].seconds_per_token
    nodes = [node("capped", 0, 39, 1000.0, sessions=2, max_sessions=2), node("slow", 0, 39, 10.0)]
    plan = plan_routes(nodes, "m")
    assert [spans(r) for r in plan.routes] == [[("slow", 0, 39)]]
    assert plan.skipped == (("capped", "at capacity 2/2"),)


def test_fingerprint_mismatch_never_chains():
    nodes = [node("a", 0, 19, fp="q4"), node("b", 20, 39, fp="f32")]
    plan = plan_routes(nodes, "m")
    assert plan.routes == ()
    assert plan.gaps in (((20, 39),), ((0, 19),))
    nodes.append(node("c", 20, 39, fp="q4"))
    plan = plan_routes(nodes, "m")
    assert [spans(r) for r in plan.routes] == [[("a", 0, 19), ("c", 20, 39)]]
    assert plan.best.fingerprint == "q4"


def test_nodes_with_different_weights_are_named_not_just_a_gap():
    nodes = [node("a", 0, 19, fp="4d87456e00"), node("b", 20, 39, fp="319a3d2a00"), node("x", 0, 39, model="other")]
    plan = plan_routes(nodes, "m")
    assert [g.nodes for g in plan.differ] == [(("a", 0, 19),), (("b", 20, 39),)]
    reason = plan.describe_missing()
    assert "weights differ" in reason and "a [0-19] (fingerprint 4d87456e" in reason
    assert "b [20-39] (fingerprint 319a3d2a" in reason and "--quant" in reason
    assert plan_routes(nodes, "other").differ == ()
    quantized = plan_routes([node("a", 0, 19, fp="370161de99"), node("b", 20, 39, fp="370161de99:int8")], "m")
    assert "370161de:int8" in quantized.describe_differ()  # the short form keeps the quantization
    agreeing = plan_routes([node("a", 0, 19), node("b", 20, 39)], "m")
    assert agreeing.differ == () and "weights differ" not in agreeing.describe_differ()


def test_single_full_node_vs_a_faster_pipeline():
    nodes = [node("full", 0, 39, 100.0), node("h", 0, 19, 1000.0), node("t", 20, 39, 1000.0)]
    plan = plan_routes(nodes, "m")
    assert spans(plan.best) == [("h", 0, 19), ("t", 20, 39)]
    assert plan.best.estimated_tps > plan.routes[-1].estimated_tps
    # A pipeline only 2% faster than the single node does not outrank it (5% margin).
    nodes = [node("full", 0, 39, 100.0), node("h", 0, 19, 102.0), node("t", 20, 39, 102.0)]
    plan = plan_routes(nodes, "m", cost=NO_LINK)
    assert spans(plan.best) == [("full", 0, 39)]
    assert plan.routes[1].seconds_per_token < plan.routes[0].seconds_per_token


def test_equal_estimates_prefer_the_single_node():
    nodes = [node("full", 0, 39), node("h", 0, 19), node("t", 20, 39)]
    plan = plan_routes(nodes, "m", cost=CostModel(link_cost_s=0.0, pipeline_margin=0.0))
    assert spans(plan.best) == [("full", 0, 39)]


def test_three_way_chain_ignores_other_models():
    nodes = [node("c", 20, 29, layers=30), node("a", 0, 9, layers=30),
             node("b", 10, 19, layers=30), node("x", 0, 29, 1e6, model="other", layers=30)]
    plan = plan_routes(nodes, "m")
    assert [spans(r) for r in plan.routes] == [[("a", 0, 9), ("b", 10, 19), ("c", 20, 29)]]
    assert plan.best.seconds_per_token == pytest.approx(30 / 100.0 + 3 * CostModel().link_cost_s)


def test_a_node_is_never_used_twice_in_one_route():
    # Re-entering "a" after the very fast "b" would be cheaper, but is not a route.
    nodes = [node("a", 0, 39, 100.0), node("b", 10, 19, 1e6)]
    plan = plan_routes(nodes, "m", cost=NO_LINK)
    assert [spans(r) for r in plan.routes] == [[("a", 0, 39)]]


def test_measured_throughput_overrides_the_benchmark_prior():
    nodes = [node("a", 0, 39, 1000.0), node("b", 0, 39, 100.0)]
    assert spans(plan_routes(nodes, "m").best) == [("a", 0, 39)]
    plan = plan_routes(nodes, "m", throughput={("a", "m"): 50.0})
    assert spans(plan.best) == [("b", 0, 39)]
    assert plan.routes[1].seconds_per_token == pytest.approx(40 / 50.0)
    # A measurement for another model does not apply.
    assert spans(plan_routes(nodes, "m", throughput={("a", "n"): 1.0}).best) == [("a", 0, 39)]


def test_layer_count_groups_and_unknown_models():
    nodes = [node("a", 0, 29, layers=30), node("b", 0, 39, layers=40, fp="other")]
    assert {len(r.hops) for r in plan_routes(nodes, "m").routes} == {1}
    plan = plan_routes(nodes, "m", num_layers=40)
    assert [spans(r) for r in plan.routes] == [[("b", 0, 39)]]
    assert plan_routes(nodes, "nope").routes == ()
    assert set(plan_all(nodes)) == {"m"}


def test_max_routes_and_estimate_route_agree_with_the_plan():
    nodes = [node(f"n{i}", 0, 39, 100.0 + i) for i in range(6)]
    plan = plan_routes(nodes, "m", max_routes=4)
    assert len(plan.routes) == 4
    by_id = {n.node_id: n for n in nodes}
    for route in plan.routes:
        assert estimate_route(route.hops, by_id) == pytest.approx(route.seconds_per_token)
    assert estimate_route((Hop("ghost", "tcp://x:1", 0, 39),), by_id) is None


def _brute_force_best(nodes, num_layers: int, cost: CostModel) -> float:
    """Cheapest route over every possible switch layer and node order (tiny inputs only),
    priced over the whole snapshot as the planner prices it (an unmeasured link costs the
    median of the swarm's measured ones)."""
    best = float("inf")
    by_id = {n.node_id: n for n in nodes}
    for k in range(1, len(nodes) + 1):
        for order in itertools.permutations(nodes, k):
            for cuts in itertools.combinations(range(1, num_layers), k - 1):
                bounds = (0, *cuts, num_layers)
                hops = [Hop(n.node_id, n.endpoint, a, b - 1)
                        for n, a, b in zip(order, bounds, bounds[1:])]
                if all(n.start_layer <= h.start_layer and h.end_layer <= n.end_layer
                       for n, h in zip(order, hops)):
                    best = min(best, estimate_route(hops, by_id, cost=cost))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_random_topologies_are_valid_and_optimal(seed):
    rng = random.Random(seed)
    num_layers = rng.randint(4, 8)
    nodes = []
    for i in range(rng.randint(1, 4)):
        a = rng.randrange(num_layers)
        nodes.append(node(f"n{i}", a, rng.randrange(a, num_layers), rng.choice([50.0, 100.0, 400.0]),
                          layers=num_layers, sessions=rng.choice([0, 0, 1]), fp=rng.choice(["f1", "f1", "f2"])))
    cost = CostModel(link_cost_s=rng.choice([0.0, 0.002, 0.05]), pipeline_margin=0.0)
    plan = plan_routes(nodes, "m", cost=cost)
    assert_valid(plan, nodes, num_layers)
    groups = {}
    for n in nodes:
        groups.setdefault(n.fingerprint, []).append(n)
    optimum = min(_brute_force_best(g, num_layers, cost) for g in groups.values())
    if optimum == float("inf"):
        assert plan.routes == () and plan.gaps
    else:
        assert plan.best.seconds_per_token == pytest.approx(optimum)


def test_coverage_gaps():
    assert coverage_gaps([], 4) == ((0, 3),)
    assert coverage_gaps([node("a", 1, 1, layers=4)], 4) == ((0, 0), (2, 3))
    assert coverage_gaps([node("a", 0, 3, layers=4)], 4) == ()


def test_assign_span_picks_the_least_covered_layers():
    assert assign_span([], "m", 30, 15) == (0, 14)
    nodes = [node("a", 0, 14, layers=30)]
    assert assign_span(nodes, "m", 30, 15) == (15, 29)
    assert assign_span(nodes, "m", 30, 20) == (10, 29)
    assert assign_span(nodes, "m", 30, 0) == (0, 29)
    assert assign_span(nodes, "m", 30, 99) == (0, 29)
    assert assign_span(nodes, "other", 30, 15) == (0, 14)
    nodes.append(node("b", 15, 29, layers=30))
    nodes.append(node("c", 0, 9, layers=30))
    assert assign_span(nodes, "m", 30, 10) == (10, 19)


# --------------------------------------------------------------------------- measured links and relays


def linked(nodes, ms: float, relayed=()) -> list:
    """The same nodes with every pair ``ms`` apart (as each measured it), some behind a relay."""
    from dataclasses import replace

    return [replace(n, rtts={o.node_id: ms for o in nodes if o is not n},
                    relay="tcp://relay:5557" if n.node_id in relayed else "") for n in nodes]


def test_with_30ms_links_the_planner_prefers_the_node_that_holds_more_layers():
    # two fast halves, or one slower node holding everything
    nodes = [node("a", 0, 19, 2000.0), node("b", 20, 39, 2000.0), node("c", 0, 39, 1500.0)]
    assert spans(plan_routes(nodes, "m").best) == [("a", 0, 19), ("b", 20, 39)]  # links unknown: 2 ms
    lan = plan_routes(linked(nodes, 0.5), "m")  # a LAN: the pipeline still wins
    assert spans(lan.best) == [("a", 0, 19), ("b", 20, 39)]
    wan = plan_routes(linked(nodes, 60.0), "m")  # 30 ms each way
    assert spans(wan.best) == [("c", 0, 39)]
    pipeline = [r for r in wan.routes if len(r.hops) == 2][0]
    assert pipeline.seconds_per_token == pytest.approx(20 / 2000 * 2 + 2 * 0.030)


def test_with_30ms_links_two_hops_beat_three_when_one_node_holds_two_thirds():
    nodes = [node("x", 0, 13, 2000.0), node("y", 14, 26, 2000.0), node("z", 27, 39, 2000.0),
             node("w", 0, 26, 1200.0)]
    assert [h.node for h in plan_routes(nodes, "m").best.hops] == ["x", "y", "z"]
    wan = plan_routes(linked(nodes, 60.0), "m")
    assert spans(wan.best) == [("w", 0, 26), ("z", 27, 39)]
    assert_valid(wan, nodes, 40)


def test_a_round_trip_measured_by_either_end_counts_and_unknown_links_cost_the_default():
    from dataclasses import replace

    cost = CostModel()
    a, b = node("a", 0, 19), node("b", 20, 39)
    assert link_between(a, b, cost) == cost.link_cost_s
    assert link_between(replace(a, rtts={"b": 10.0}), b, cost) == pytest.approx(0.005)
    assert link_between(a, replace(b, rtts={"a": 10.0}), cost) == pytest.approx(0.005)
    hops = (Hop("a", a.endpoint, 0, 19), Hop("b", b.endpoint, 20, 39))
    by_id = {"a": replace(a, rtts={"b": 10.0}), "b": b}
    assert route_link_seconds(hops, by_id, cost) == pytest.approx(0.010)  # a -> b, and the token back
    assert route_link_seconds(hops[:1], by_id, cost) == 0.0


def test_an_unmeasured_link_costs_the_median_measured_one_not_less():
    """h can hand off to t1 over a link measured fast for this swarm (6 ms round trip, where
    the other links measured take 40 ms), or to t2, as fast a node, over a link nobody has
    measured yet. Priced at the small default (1 ms each way), the unmeasured link made t2's
    route the best; priced as the swarm's typical link, the measured fast one wins."""
    from dataclasses import replace

    h, t1, t2 = node("h", 0, 19, 1000.0), node("t1", 20, 39, 1000.0), node("t2", 20, 39, 1000.0)
    x, y = node("x", 0, 39, model="other"), node("y", 0, 39, model="other")
    nodes = [replace(h, rtts={"t1": 6.0, "x": 40.0}), t1, t2, replace(x, rtts={"y": 40.0, "h": 40.0}), y]
    plan = plan_routes(nodes, "m", cost=CostModel(link_cost_s=0.001))
    assert [spans(r) for r in plan.routes[:2]] == [[("h", 0, 19), ("t1", 20, 39)], [("h", 0, 19), ("t2", 20, 39)]]
    median_one_way = 0.020  # of 6, 40, 40, 40 ms round trips
    gap = plan.routes[1].seconds_per_token - plan.routes[0].seconds_per_token
    assert gap == pytest.approx(2 * (median_one_way - 0.003))  # h -> t2 and back, against 3 ms each way
    by_id = {n.node_id: n for n in nodes}
    for route in plan.routes:
        assert estimate_route(route.hops, by_id, cost=CostModel(link_cost_s=0.001)) == \
            pytest.approx(route.seconds_per_token)
    # while no link is measured, an unmeasured one costs the default
    assert route_link_seconds(plan.routes[1].hops, {"h": h, "t2": t2}, CostModel(link_cost_s=0.001)) == \
        pytest.approx(0.002)


def test_a_relayed_hop_costs_an_extra_traversal():
    cost = CostModel(relay_penalty_s=0.003)
    direct, relayed = node("t1", 20, 39), node("t2", 20, 39)
    nodes = linked([node("h", 0, 19), direct, relayed], 4.0, relayed={"t2"})
    plan = plan_routes(nodes, "m", cost=cost)
    assert [spans(r) for r in plan.routes[:2]] == [[("h", 0, 19), ("t1", 20, 39)], [("h", 0, 19), ("t2", 20, 39)]]
    gap = plan.routes[1].seconds_per_token - plan.routes[0].seconds_per_token
    assert gap == pytest.approx(cost.relay_penalty_s)  # h -> t2 pays it; the token back to h does not
    by_id = {n.node_id: n for n in nodes}
    assert estimate_route(plan.routes[1].hops, by_id, cost=cost) == pytest.approx(plan.routes[1].seconds_per_token)
    # a relayed head pays it on the token's way back
    head_relayed = linked([node("h", 0, 19), direct], 4.0, relayed={"h"})
    route = plan_routes(head_relayed, "m", cost=cost).best
    assert route.seconds_per_token == pytest.approx(2 * 20 / 100 + 2 * 0.002 + cost.relay_penalty_s)


def test_the_relay_penalty_can_tip_the_plan_away_from_a_relayed_node():
    cost = CostModel(relay_penalty_s=0.02)
    nodes = [node("h", 0, 19, 2000.0), node("t", 20, 39, 2000.0), node("full", 0, 39, 1500.0)]
    assert [h.node for h in plan_routes(linked(nodes, 0.5), "m", cost=cost).best.hops] == ["h", "t"]
    best = plan_routes(linked(nodes, 0.5, relayed={"t"}), "m", cost=cost).best
    assert spans(best) == [("h", 0, 19), ("full", 20, 39)]  # the tail that needs no relay
    assert spans(plan_routes(linked(nodes, 0.5, relayed={"t", "full"}), "m", cost=cost).best) == [("full", 0, 39)]


@pytest.mark.parametrize("seed", range(30))
def test_random_topologies_with_measured_links_and_relays_are_optimal(seed):
    from dataclasses import replace

    rng = random.Random(1000 + seed)
    num_layers = rng.randint(4, 7)
    nodes = []
    for i in range(rng.randint(2, 4)):
        a = rng.randrange(num_layers)
        nodes.append(node(f"n{i}", a, rng.randrange(a, num_layers), rng.choice([50.0, 100.0, 400.0]),
                          layers=num_layers))
    ids = [n.node_id for n in nodes]
    nodes = [replace(n, relay="tcp://r:1" if rng.random() < 0.3 else "",
                     rtts={o: rng.choice([1.0, 10.0, 80.0]) for o in ids if o != n.node_id and rng.random() < 0.6})
             for n in nodes]
    cost = CostModel(link_cost_s=0.004, relay_penalty_s=rng.choice([0.0, 0.01]), pipeline_margin=0.0)
    plan = plan_routes(nodes, "m", cost=cost, max_routes=40)  # room for every label: no pruning
    assert_valid(plan, nodes, num_layers)
    by_id = {n.node_id: n for n in nodes}
    for route in plan.routes:
        assert estimate_route(route.hops, by_id, cost=cost) == pytest.approx(route.seconds_per_token)
    optimum = _brute_force_best(nodes, num_layers, cost)
    if optimum == float("inf"):
        assert plan.routes == ()
    else:
        assert plan.best.seconds_per_token == pytest.approx(optimum)


def test_a_thousand_nodes_over_two_hundred_layers_plan_valid_routes():
    """The scale the tracker must plan at (bench/swarm_scale.py times it): every route
    covers every layer contiguously, inside each node's shard, no node twice."""
    from dataclasses import replace

    rng = random.Random(7)
    num_layers = 200
    nodes = []
    for i in range(1000):
        width = rng.randint(5, 40)
        start = min(i * 5, num_layers - width) if i < 40 else rng.randrange(num_layers - width + 1)
        nodes.append(node(f"n{i:04d}", start, start + width - 1, rng.uniform(200.0, 4000.0), layers=num_layers,
                          sessions=rng.choice([0, 0, 1])))
    ids = [n.node_id for n in nodes]
    nodes = [replace(n, rtts={p: rng.uniform(0.2, 80.0) for p in rng.sample(ids, 32) if p != n.node_id})
             for n in nodes]
    plan = plan_routes(nodes, "m", max_routes=3)
    assert len(plan.routes) == 3 and plan.gaps == ()
    assert_valid(plan, nodes, num_layers)
    by_id = {n.node_id: n for n in nodes}
    for route in plan.routes:
        assert estimate_route(route.hops, by_id) == pytest.approx(route.seconds_per_token)
