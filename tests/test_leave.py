"""A polite leave and a quiet join (issue 17, item 4).

On SIGTERM a node tells the tracker it leaves, refuses new sessions with ``leaving`` (the
client goes to another head, a head around the hop), finishes the sessions it serves and
exits within ``--drain-timeout``. A node that joins while the swarm serves takes new
sessions and disturbs none. Units, then real processes under steady load.
"""
from __future__ import annotations

import signal
import threading
import time

import pytest

from fabric import Client
from fabric.client import HeadDied, HeadGone, HeadLeaving
from fabric.client.core import GenerateArgs
from fabric.client.stream import Continuation, RequestStream
from fabric.compute.kv import KVStore, SessionKV
from fabric.node.leave import Departure
from fabric.wire import protocol as p
from fabric.wire.liveness import PEER_SILENCE
from tests.support import wait_for
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy
from tracker.service import Tracker, TrackerConfig

NEW_TOKENS = 32
DRAIN = 12.0  # the leaving node's --drain-timeout


def _forward(session: str, pos: int) -> p.Forward:
    spec = p.TensorSpec("int64", (1, 1))
    return p.Forward(session=session, step=0, pos=pos, start_layer=3, end_layer=5, route=(), reply_to="tcp://h:1",
                     tensors=(spec,))


def test_a_leaving_node_refuses_only_new_sessions_and_exits_when_they_end():
    d = Departure("n1", timeout=10.0)
    assert not d.refuses(_forward("s", 0), holds=False)  # not leaving: the node takes it
    assert d.begin(100.0, serving=2) and not d.begin(101.0, serving=2)
    assert d.refuses(_forward("new", 0), holds=False)
    assert not d.refuses(_forward("held", 0), holds=True)  # a re-prefill of a session it serves
    assert not d.refuses(_forward("held", 7), holds=False)  # a later chunk or step: its head decides
    refusal = d.refusal("new", 0)
    assert (refusal.code, refusal.session, refusal.step, refusal.node) == (p.ErrorCode.LEAVING, "new", 0, "n1")
    assert not d.over(105.0, serving=1)
    assert d.over(105.0, serving=0)
    assert d.over(110.0, serving=1)  # the deadline: the rest go to their heads' failover


def test_a_session_whose_head_went_quiet_does_not_hold_the_leave():
    kv = KVStore()
    kv.put("live", SessionKV(cache=None, start=0, end=2, last_used=100.0))
    kv.put("orphan", SessionKV(cache=None, start=0, end=2, last_used=100.0 - 2 * PEER_SILENCE))
    assert len(kv) == 2 and kv.active(100.0 + PEER_SILENCE / 2, PEER_SILENCE) == 1
    assert kv.active(100.0 + 2 * PEER_SILENCE, PEER_SILENCE) == 0  # both heads gone: leave now


def test_the_tracker_drops_a_leaving_node_from_its_plans():
    tracker = Tracker(TrackerConfig(db=":memory:", reach_timeout=0))
    for node, start, end in (("a", 0, 2), ("b", 3, 5), ("c", 3, 5)):
        tracker.handle(p.Register(node_id=node, endpoint=f"tcp://127.0.0.1:1{start}{end}", model="m",
                                  fingerprint="f", num_layers=6, start_layer=start, end_layer=end))
    assert tracker.handle(p.Leave("b")).detail == "left"
    assert tracker.handle(p.Leave("b")).detail == "unknown node"
    assert "b" not in {h.node for plan in tracker.status_body()["plans"]["m"] for h in _hops(plan)}
    assert [h.node for h in tracker.handle(p.RouteRequest("m")).hops] == ["a", "c"]
    left = [e for e in tracker.events.recent(limit=10) if e["kind"] == "left"]
    assert [(e["node"], e["code"]) for e in left] == [("b", "left")]


def _hops(plan: dict) -> list[p.Hop]:
    return [p.Hop(h["node"], h["endpoint"], h["start_layer"], h["end_layer"]) for h in plan["hops"]]


def test_clients_and_heads_go_around_a_leaving_node(thread_cluster, tiny_models):
    """a1 and b1 leave but are still in the tracker's plans (their LEAVE not yet taken): a
    GENERATE to a1 is refused and the client goes to a2; a FORWARD that would start a session
    on b1 is refused and the head goes to b2. The text is the reference's."""
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), NEW_TOKENS)
    nodes = {name: thread_cluster.add_node(model, start, end, 6, name)
             for name, start, end in (("a1", 0, 2), ("a2", 0, 2), ("b1", 3, 5), ("b2", 3, 5))}
    thread_cluster.wait_routable(model.name, 4)
    hop = {name: p.Hop(name, n.endpoint, n.config.shard.start, n.config.shard.end) for name, n in nodes.items()}
    for name in ("a1", "b1"):
        nodes[name].departure.begin(time.monotonic(), serving=0)

    class FirstToTheLeaver(Client):
        asked = 0

        def _route_program(self, model, exclude=()):  # the one route program both shells drive
            self.asked += 1
            if self.asked == 1:
                return (hop["a1"], hop["b2"])
            return (yield from super()._route_program(model, exclude))

    with FirstToTheLeaver(thread_cluster.endpoint, timeout=30) as client:
        events = list(client.generate(model.name, messages=MESSAGES, max_tokens=NEW_TOKENS))
        assert [t for e in events for t in e.token_ids] == expected
        assert events[-1].route[0].node == "a2"
        assert (client.routes.leaving, client.routes.dead) == ({"a1"}, set())  # alive, only leaving
        events = list(client.generate(model.name, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                      route=(hop["a2"], hop["b1"])))
    assert [t for e in events for t in e.token_ids] == expected
    assert [h.node for h in events[-1].route] == ["a2", "b2"]
    assert nodes["a2"].counters["failovers"] >= 1


def test_a_leaving_head_is_booked_as_leaving_and_a_remembered_route_avoids_it():
    """A refusal as leaving is a HeadGone (the request goes on elsewhere) but no HeadDied: the
    client books the head as leaving, and only the tracker's next word about it forgets that."""
    a1, a2, b = (p.Hop(n, f"tcp://127.0.0.1:{port}", s, e) for n, port, s, e in
                 (("a1", 1, 0, 2), ("a2", 2, 0, 2), ("b", 3, 3, 5)))
    gone = HeadLeaving(a1, "node a1 is leaving the swarm: use another node")
    assert isinstance(gone, HeadGone) and not isinstance(gone, HeadDied) and gone.code == p.ErrorCode.LEAVING
    with Client("tcp://127.0.0.1:1") as client:
        client.routes.learn("m", (a2, b))
        client.routes.learn("m", (a1, b))  # the best route now
        request = RequestStream(client, GenerateArgs.of("m", prompt="hi"), None)
        request.stream = Continuation(p.Generate(request_id="r", route=(a1, b), prompt="hi"), fixed_route=False)
        assert request._around(gone) == [("a1",)]
        assert (client.routes.leaving, client.routes.dead) == ({"a1"}, set())
        assert client.routes.instead("m") == (a2, b)
        request._around(HeadDied(a2))
        assert (client.routes.leaving, client.routes.dead) == ({"a1"}, {"a2"})
        client.routes.learn("m", (a1, b))  # the tracker routes through a1 again: it stayed
        assert client.routes.leaving == set() and client.routes.instead("m") == (a1, b)


# --------------------------------------------------------------------------- real processes


class Load:
    """``clients`` threads, each streaming greedy requests one after another until ``stop``;
    every request's tokens, the nodes of the route it ended on, its end time, or its error."""

    def __init__(self, cluster, model: str, clients: int = 3):
        self.cluster, self.model = cluster, model
        self.results: list[dict] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _run(self) -> None:
        with self.cluster.client() as client:
            while not self.stop.is_set():
                self.results.append(self._one(client))

    def _one(self, client) -> dict:
        started = time.monotonic()
        try:
            events = list(client.generate(self.model, messages=MESSAGES, max_tokens=NEW_TOKENS))
        except Exception as exc:  # a failed request: the tests count them (there must be none)
            return {"error": repr(exc), "started": started, "ended": time.monotonic()}
        return {"tokens": [t for e in events for t in e.token_ids], "started": started, "ended": time.monotonic(),
                "nodes": {h.node for h in events[-1].route}}

    def done(self) -> int:
        return len(self.results)


def _sessions(cluster, name: str) -> int:
    from tests.cluster import ping

    pong = ping(cluster.node_endpoints[name], 2.0)
    return pong.sessions if pong else 0


def _leave(cluster, name: str) -> str:
    """SIGTERM ``name`` and wait for its exit (0 is its status); its log."""
    proc = cluster.procs.pop(name)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DRAIN + 15) == 0, cluster.logs()
    return (cluster.tmp / f"{name}.log").read_text()


@pytest.mark.parametrize("role", ["tail", "head"])
def test_sigterm_of_a_serving_node_under_load_fails_no_request(process_cluster, tiny_models, role):
    cluster, model = process_cluster, tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), NEW_TOKENS)
    drain = ("--drain-timeout", str(DRAIN))
    heads, tails = (["a1", "a2"], ["b"]) if role == "head" else (["a"], ["b1", "b2"])
    for name in heads:
        cluster.start_node(name, str(model), "0-2", None, *drain)
    for name in tails:
        cluster.start_node(name, str(model), "3-5", None, *drain)
    cluster.wait_nodes(heads + tails, model.name)
    pool = heads if role == "head" else tails
    with Load(cluster, model.name) as load:
        assert wait_for(lambda: load.done() >= 3 and any(_sessions(cluster, n) for n in pool), 60, 0.02)
        leaver = max(pool, key=lambda n: _sessions(cluster, n))  # the one serving streams now
        said = _leave(cluster, leaver)
        gone_at, before = time.monotonic(), load.done()
        assert wait_for(lambda: load.done() >= before + 6, 60)
    failed = [r for r in load.results if "error" in r]
    assert not failed, (failed, cluster.logs())
    assert all(r["tokens"] == expected for r in load.results)
    # it left because its streams ended, not because the drain deadline cut them (leave.py says which)
    assert "every session ended" in said and "still running" not in said, said[-3000:]
    after = [r for r in load.results if r["started"] > gone_at]
    assert after and not any(leaver in r["nodes"] for r in after)


def test_a_node_joining_mid_load_disturbs_nothing_and_takes_new_sessions(process_cluster, tiny_models):
    cluster, model = process_cluster, tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), NEW_TOKENS)
    cluster.split(model, ("a", "b"))
    with Load(cluster, model.name) as load:
        assert wait_for(lambda: load.done() >= 3, 60)
        cluster.start_node("c", str(model), "3-5")
        with cluster.client() as client:
            assert wait_for(lambda: "c" in {n["id"] for n in client.status()["nodes"]}, 60)
        joined_at = time.monotonic()
        assert wait_for(lambda: any("c" in r.get("nodes", ()) for r in load.results), 60), cluster.logs()
        before = load.done()
        assert wait_for(lambda: load.done() >= before + 3, 60)
    failed = [r for r in load.results if "error" in r]
    assert not failed, (failed, cluster.logs())
    assert all(r["tokens"] == expected for r in load.results)
    assert any(r["started"] < joined_at < r["ended"] for r in load.results)  # streams ran through the join
