"""The tracker against real node processes: honest plans, expiry, restarts."""
from __future__ import annotations

import signal

from fabric.wire import protocol as p
from tests.support import wait_for
from tests.test_fabric_equivalence import MESSAGES
from tests.test_processes import token_ids


def hops_of(plan: dict) -> tuple[p.Hop, ...]:
    return tuple(p.Hop(h["node"], h["endpoint"], h["start_layer"], h["end_layer"]) for h in plan["hops"])


def test_partial_head_plus_full_node_plans_continue_after_the_head(process_cluster, tiny_models):
    model = tiny_models("llama")
    process_cluster.start_node("partial", str(model), "0-2")
    process_cluster.start_node("full", str(model), "0-5")
    status = process_cluster.wait_nodes(["partial", "full"], model.name)
    plans = status["plans"][model.name]
    two_hop = [pl for pl in plans if len(pl["hops"]) == 2]
    assert two_hop, plans  # ranked alternatives include the pipeline
    for plan in plans:
        starts = [h["start_layer"] for h in plan["hops"]]
        ends = [h["end_layer"] for h in plan["hops"]]
        assert starts == [0] + [e + 1 for e in ends[:-1]] and ends[-1] == 5
    assert [(h["node"], h["start_layer"]) for h in two_hop[0]["hops"]] == [("partial", 0), ("full", 3)]
    with process_cluster.client() as client:
        direct = [pl for pl in plans if len(pl["hops"]) == 1][0]
        via_head = token_ids(client.generate(model.name, messages=MESSAGES, max_tokens=24,
                                             route=hops_of(two_hop[0])))
        alone = token_ids(client.generate(model.name, messages=MESSAGES, max_tokens=24, route=hops_of(direct)))
    assert via_head == alone and len(via_head) > 3


def test_killed_node_leaves_the_plans(process_cluster, tiny_models):
    model = tiny_models("llama")
    process_cluster.start_node("a", str(model), "0-5")
    process_cluster.start_node("b", str(model), "0-5")
    process_cluster.wait_nodes(["a", "b"], model.name)
    process_cluster.kill("b", signal.SIGKILL)
    with process_cluster.client() as client:
        def b_gone():
            status = client.status()
            in_plans = {h["node"] for pl in status["plans"].get(model.name, []) for h in pl["hops"]}
            return "b" not in in_plans and "b" not in {n["id"] for n in status["nodes"]}
        # expiry is 3 missed heartbeats (0.3 s each); allow two more intervals of slack
        assert wait_for(b_gone, timeout=0.3 * 5 + 1.0, interval=0.05)
        assert token_ids(client.generate(model.name, messages=MESSAGES, max_tokens=8))


def test_tracker_restart_repopulates_and_keeps_the_ledger(process_cluster, tiny_models):
    model = tiny_models("llama")
    process_cluster.split(model)
    with process_cluster.client() as client:
        token_ids(client.generate(model.name, messages=MESSAGES, max_tokens=12, api_key="k1"))
        assert wait_for(lambda: client.status()["usage"]["totals"].get("billed", {}).get("requests") == 1)
        before = client.status()["usage"]
    process_cluster.kill("tracker", signal.SIGKILL)
    process_cluster.start_tracker()
    status = process_cluster.wait_nodes(["a", "b"], model.name, timeout=30)
    assert status["usage"]["totals"] == before["totals"]
    with process_cluster.client() as client:
        assert token_ids(client.generate(model.name, messages=MESSAGES, max_tokens=12))


def test_nodes_without_layers_get_the_least_covered_span_that_fits(process_cluster, tiny_models):
    """Each tiny layer is ~150 KB in float32: a 0.00042 GiB budget holds 3 of the 6 layers."""
    model = tiny_models("llama")
    process_cluster.start_node("first", str(model), None, None, "--memory", "0.00042")
    with process_cluster.client() as client:
        assert wait_for(lambda: len(client.status()["nodes"]) == 1, 60)
        process_cluster.start_node("second", str(model), None, None, "--memory", "0.00042")
        assert wait_for(lambda: client.status()["plans"].get(model.name), 60), process_cluster.logs()
        nodes = client.status()["nodes"]
    assert sorted(tuple(n["layers"]) for n in nodes) == [(0, 2), (3, 5)]
    first_id = [n["id"] for n in nodes if n["layers"] == [0, 2]][0]
    # a restarted node keeps its id (from its key file)
    endpoint = process_cluster.node_endpoints["first"]
    process_cluster.kill("first")
    process_cluster.start_node("first", str(model), None, int(endpoint.rsplit(":", 1)[1]), "--memory", "0.00042")
    with process_cluster.client() as client:
        assert wait_for(lambda: any(n["id"] == first_id and n["endpoint"] == endpoint
                                    for n in client.status()["nodes"]), 60), process_cluster.logs()
    assert first_id.startswith("node-")
