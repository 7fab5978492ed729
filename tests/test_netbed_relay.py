"""Relays and latency-aware planning across hosts (network namespaces, tests/netbed.py).

Each test makes its own bed: hosts on one switch with per-link delay, a host that nobody
can connect to (as behind NAT), and real `meshnet tracker`, `relay` and `node` processes.
"""
from __future__ import annotations

import itertools

import pytest

from tests import netbed as nb
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy

DELAY = 0.002  # one way, on a near host's link
TOKENS = 24
RELAY_PORT = 7000
FRONT_PORTS = (7001, 7004)  # the relay's fronts bind in this range (exposed like any service)


def token_ids(events) -> list[int]:
    return [t for e in events if e["event"] == "token" for t in e["ids"]]


def _nodes(status: dict) -> dict:
    return {n["id"]: n for n in status["nodes"]}


def _start_one_by_one(bed: nb.Netbed, nodes: dict[str, str], model) -> None:
    """Start each node once the one before has registered: a node measures its speed as
    it starts, and the planner should not see the noise of four starting at once."""
    with bed.client("tracker") as agent:
        for host, span in nodes.items():
            bed.start_node(host, model, span)
            assert nb.wait_until(lambda: host in _nodes(agent.status()), 120), bed.logs()


def _start_relay(bed: nb.Netbed, host: str):
    control, *_ = bed.expose(host, RELAY_PORT, *range(FRONT_PORTS[0], FRONT_PORTS[1] + 1))
    bed.spawn_cli(host, "relay", "relay", "--bind", control.bind, "--advertise-host", bed.hosts[host].ip,
                  "--front-ports", f"{FRONT_PORTS[0]}-{FRONT_PORTS[1]}")
    return control


def test_nodes_without_inbound_serve_through_a_relay(netbed, tiny_models):
    """Head and tail each sit on a host nobody can connect to: every frame to them (GENERATE,
    FORWARD, TOKEN, PING) goes through the relay's fronts, and the tokens are unchanged."""
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), TOKENS)
    for host in ("tracker", "relay", "client"):
        netbed.add_host(host, delay=DELAY)
    for host in ("nat1", "nat2"):
        netbed.add_host(host, delay=DELAY, inbound=False)
    netbed.start_tracker("tracker")
    control = _start_relay(netbed, "relay")
    relay_ip = netbed.hosts["relay"].ip
    bound = {name: netbed.start_node(name, model, layers, "--relay", control.endpoint)
             for name, layers in (("nat1", "0-2"), ("nat2", "3-5"))}
    with netbed.client("client") as client:
        status = client.wait_nodes(["nat1", "nat2"], model.name)
        nodes = _nodes(status)
        for name in ("nat1", "nat2"):
            assert nodes[name]["relayed"] and nodes[name]["relay"] == control.endpoint
            assert nodes[name]["endpoint"].startswith(f"tcp://{relay_ip}:")  # its front, on the relay's host
        hops = status["plans"][model.name][0]["hops"]
        assert [(h["node"], h.get("relay")) for h in hops] == [("nat1", control.endpoint),
                                                                ("nat2", control.endpoint)]
        events = list(client.generate(model.name, MESSAGES, TOKENS))
        assert token_ids(events) == expected
        with pytest.raises(nb.AgentError):  # the node's own socket is out of reach
            client.ping(bound["nat1"], 1, timeout=2)


def test_a_node_the_tracker_cannot_reach_falls_back_to_its_relay(netbed, tiny_models):
    """Started without --relay, a node behind NAT registers the address it was told to
    advertise; the tracker cannot reach it there, says so, and the node switches to the
    relay it was given with --relay-fallback."""
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), TOKENS)
    for host in ("tracker", "relay", "head", "client"):
        netbed.add_host(host, delay=DELAY)
    netbed.add_host("nat", delay=DELAY, inbound=False)
    netbed.start_tracker("tracker")
    control = _start_relay(netbed, "relay")
    netbed.start_node("head", model, "0-2")
    advertised = netbed.start_node("nat", model, "3-5", "--relay-fallback", control.endpoint)
    with netbed.client("client") as client:
        def relayed():
            node = _nodes(client.status()).get("nat")
            return node if node and node["relayed"] and node["reachable"] else None
        assert nb.wait_until(relayed, 60), netbed.logs()
        node = relayed()
        assert node["relay"] == control.endpoint and node["endpoint"] != advertised
        events = client.status()["events"]
        assert any(e.get("code") == "unreachable" and e.get("node") == "nat" for e in events)
        client.wait_nodes(["head", "nat"], model.name)
        assert token_ids(client.generate(model.name, MESSAGES, TOKENS)) == expected


def test_with_30ms_links_the_plan_takes_fewer_hops_and_predicts_the_decode_rate(netbed, tiny_models):
    """Nodes 30 ms apart (15 ms on each host's link): the nodes measure it, the planner
    ranks the 2-hop route over the 3-hop one by that measure, and the rate it predicts
    for the route is close to the one requests on it get."""
    model = tiny_models("llama")
    netbed.add_host("tracker", delay=DELAY)
    netbed.add_host("client", delay=DELAY)
    layers = {"a": "0-1", "b": "2-3", "c": "4-5", "w": "0-3"}  # w holds what a and b hold
    for host in layers:
        netbed.add_host(host, delay=0.015)
    netbed.start_tracker("tracker")
    _start_one_by_one(netbed, layers, model)
    with netbed.client("client") as client:
        client.wait_nodes(list(layers), model.name)

        def measured():
            status = client.status()
            nodes = _nodes(status)
            # every pair: an unmeasured link costs the planner's small default, so a route
            # through one (a, w, b, c before a-w was measured) would look cheaper than it is
            known = all(nodes[x]["rtts"].get(y) or nodes[y]["rtts"].get(x) for x, y in itertools.combinations("abcw", 2))
            return status if known else None
        assert nb.wait_until(measured, 60), netbed.logs()
        status = measured()
        nodes = _nodes(status)
        rtt_wc = nodes["w"]["rtts"].get("c") or nodes["c"]["rtts"]["w"]
        assert rtt_wc >= 2 * 0.030 * 1000 * 0.9  # ms; a round trip crosses 2 x 30 ms
        plans = status["plans"][model.name]
        assert [h["node"] for h in plans[0]["hops"]] == ["w", "c"]
        three = [pl for pl in plans if [h["node"] for h in pl["hops"]] == ["a", "b", "c"]]
        assert plans[0]["seconds_per_token"] >= 2 * 0.030 * 0.9  # w -> c, and the token back
        if three:
            assert three[0]["seconds_per_token"] >= 3 * 0.030 * 0.9
        events = list(client.generate(model.name, MESSAGES, TOKENS))
        assert [h["node"] for h in events[0]["route"]] == ["w", "c"]

        def observed():
            plan = client.status()["plans"][model.name][0]
            return plan if plan.get("actual_tps") else None
        assert nb.wait_until(observed, 15)
        plan = observed()
    assert 0.5 <= plan["actual_tps"] / plan["estimated_tps"] <= 2.0, plan


def test_the_planner_picks_the_near_replica(netbed, tiny_models):
    """Two tails with the same layers, one 30 ms away and one near: once the head has
    measured both, every plan goes to the near one."""
    model = tiny_models("llama")
    for host in ("tracker", "client", "head", "near"):
        netbed.add_host(host, delay=DELAY)
    netbed.add_host("far", delay=0.030)
    netbed.start_tracker("tracker")
    _start_one_by_one(netbed, {"head": "0-2", "far": "3-5", "near": "3-5"}, model)
    with netbed.client("client") as client:
        client.wait_nodes(["head", "far", "near"], model.name)

        def both_measured():
            rtts = _nodes(client.status())["head"]["rtts"]
            return "far" in rtts and "near" in rtts
        assert nb.wait_until(both_measured, 30), netbed.logs()
        rtts = _nodes(client.status())["head"]["rtts"]
        assert rtts["far"] > rtts["near"] + 40  # ms: 2 x 28 ms more each way
        plan = client.status()["plans"][model.name][0]
        assert [h["node"] for h in plan["hops"]] == ["head", "near"]
        events = list(client.generate(model.name, MESSAGES, 8))
        assert [h["node"] for h in events[0]["route"]] == ["head", "near"]
