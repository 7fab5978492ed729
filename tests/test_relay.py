"""Relays: nodes that cannot accept inbound connections serve through `meshnet relay`.

The first tests drive a Relay thread with raw sockets (a DEALER playing the relayed node,
others playing its peers); the rest run real `meshnet relay`, `tracker` and `node`
processes on loopback.
"""
from __future__ import annotations

import json
import shutil
import signal
import threading

import pytest
import zmq

from fabric.net.relay import CONTROL, Relay, RelayConfig
from fabric.net.security import create_keys, dial_securely, load
from fabric.wire import protocol as p
from tests.cluster import free_port
from tests.support import port_is_free, wait_for
from tests.test_cli import meshnet
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.test_processes import token_ids
from tests.tiny_models import reference_greedy

TIMEOUT_MS = 5000


class RelayThread:
    def __init__(self, ctx, port: int | None = None, **kw):
        self.relay = Relay(RelayConfig(bind=f"tcp://127.0.0.1:{port or free_port()}", **kw), ctx)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.relay.run, args=(self.stop,), daemon=True)
        self.thread.start()
        assert self.relay.ready.wait(5)
        self.endpoint = self.relay.endpoint

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def relay(ctx):
    r = RelayThread(ctx, node_timeout=0.5)
    yield r
    r.close()


def dealer(ctx, endpoint: str, security=None, key=None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    dial_securely(sock, security, key)
    sock.connect(endpoint)
    return sock


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), "no answer"
    return sock.recv_multipart()


def control(sock: zmq.Socket, message: p.Message) -> p.Message:
    """Send a control message on a relay link; the decoded answer."""
    sock.send_multipart([CONTROL, *p.encode(message)])
    frames = recv(sock)
    assert frames[0] == CONTROL
    return p.decode(frames[1:])[0]


def test_front_passes_frames_both_ways_with_the_peers_identity(ctx, relay):
    node = dealer(ctx, relay.endpoint)
    opened = control(node, p.RelayOpen("n1"))
    assert isinstance(opened, p.RelayOpened) and opened.node_id == "n1" and opened.key == ""
    assert opened.endpoint.startswith("tcp://127.0.0.1:") and opened.endpoint != relay.endpoint
    peers = [dealer(ctx, opened.endpoint) for _ in range(2)]
    identities = []
    for i, peer in enumerate(peers):
        peer.send_multipart(p.encode(p.Ping(i)))
        identity, *body = recv(node)  # exactly what the node's own ROUTER would give it
        assert p.decode(body)[0] == p.Ping(i)
        identities.append(identity)
    assert len(set(identities)) == 2
    for i in (1, 0):  # replies find their peer by identity
        node.send_multipart([identities[i], *p.encode(p.Pong(i, node="n1"))])
        assert p.decode(recv(peers[i]))[0] == p.Pong(i, node="n1")
    # a keepalive answers with the same front
    assert control(node, p.RelayOpen("n1")).endpoint == opened.endpoint


@pytest.mark.parametrize("frames", [
    [CONTROL],  # nothing after the marker
    [CONTROL, b"MESH1", b"\x1e", b"\xc1"],  # bad msgpack
    [CONTROL, b"MESH2", bytes([p.Kind.RELAY_OPEN]), b"\x80"],  # another version
    [CONTROL, b"MESH1", bytes([p.Kind.RELAY_OPEN]), b"\x81\xa4node\x01"],  # unknown field
    [CONTROL, b"MESH1", bytes([p.Kind.RELAY_OPEN]), b"\x81\xa7node_id\x05"],  # int for str
    [CONTROL, *p.encode(p.RelayOpen(""))],  # empty node id
    [CONTROL, *p.encode(p.Heartbeat("n1"))],  # a kind the relay does not serve
])
def test_bad_control_frames_get_an_error_and_the_relay_carries_on(ctx, relay, frames):
    node = dealer(ctx, relay.endpoint)
    node.send_multipart(frames)
    reply = recv(node)
    assert reply[0] == CONTROL
    error = p.decode(reply[1:])[0]
    assert isinstance(error, p.Error) and error.code in (p.ErrorCode.BAD_FRAME, p.ErrorCode.VERSION,
                                                          p.ErrorCode.BAD_REQUEST)
    assert isinstance(control(node, p.RelayOpen("n1")), p.RelayOpened)


def test_data_from_a_link_without_a_front_asks_the_node_to_open_again(ctx, relay):
    node = dealer(ctx, relay.endpoint)
    node.send_multipart([b"\x00peer", *p.encode(p.Pong(1))])
    reply = recv(node)
    error = p.decode(reply[1:])[0]
    assert reply[0] == CONTROL and error.code == p.ErrorCode.UNKNOWN_NODE


def test_a_silent_node_loses_its_front_and_its_peers_see_the_link_drop(ctx, relay):
    node = dealer(ctx, relay.endpoint)
    front = control(node, p.RelayOpen("n1")).endpoint
    peer = dealer(ctx, front)
    monitor = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    peer.send_multipart(p.encode(p.Ping(1)))
    recv(node)
    assert wait_for(lambda: not relay.relay.fronts, timeout=3)  # node_timeout is 0.5 s
    assert monitor.poll(TIMEOUT_MS), "the peer's link to the closed front did not drop"
    monitor.close(linger=0)


def test_a_restarted_relay_binds_the_front_the_node_had(ctx):
    first = RelayThread(ctx)
    port = int(first.endpoint.rsplit(":", 1)[1])
    node = dealer(ctx, first.endpoint)
    front = control(node, p.RelayOpen("n1")).endpoint
    first.close()
    # ZeroMQ closes a listener in its I/O thread, after close() returns: wait until the port is
    # free, as a restarted process would find it
    assert wait_for(lambda: port_is_free(port), timeout=10)
    again = RelayThread(ctx, port)
    try:
        # the new relay does not know the link. A frame sent before the DEALER has seen the old
        # relay go rides the dead connection and is lost (ZeroMQ drops a closed pipe's queue), so
        # send again until the new relay answers: what is asserted is its answer, not the timing
        for _ in range(TIMEOUT_MS // 250):
            node.send_multipart([b"\x00peer", *p.encode(p.Pong(1))])
            if node.poll(250):
                break
        assert p.decode(recv(node)[1:])[0].code == p.ErrorCode.UNKNOWN_NODE
        while node.poll(300):  # a slow answer to an earlier try, if one came through after all
            assert p.decode(node.recv_multipart()[1:])[0].code == p.ErrorCode.UNKNOWN_NODE
        assert control(node, p.RelayOpen("n1", endpoint=front)).endpoint == front
    finally:
        again.close()


def test_a_relay_refuses_more_fronts_than_it_may_open(ctx):
    r = RelayThread(ctx, max_fronts=1)
    try:
        assert isinstance(control(dealer(ctx, r.endpoint), p.RelayOpen("n1")), p.RelayOpened)
        refused = control(dealer(ctx, r.endpoint), p.RelayOpen("n2"))
        assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.BUSY
    finally:
        r.close()


def test_secured_relay_admits_members_only_and_keeps_node_ids_to_their_keys(ctx, tmp_path):
    swarm, member, outsider = tmp_path / "swarm", tmp_path / "member", tmp_path / "outsider"
    create_keys(swarm, "swarm", tracker=True)
    create_keys(member, "member")
    create_keys(outsider, "outsider")
    shutil.copy(member / "id.key", swarm / "allowed" / "member.key")
    keys = {name: load(d) for name, d in (("swarm", swarm), ("member", member), ("outsider", outsider))}
    r = RelayThread(ctx, security=keys["swarm"])
    relay_key = keys["swarm"].public
    try:
        node = dealer(ctx, r.endpoint, keys["swarm"], relay_key)
        opened = control(node, p.RelayOpen("n1"))
        assert opened.key == keys["swarm"].public_text
        stranger = dealer(ctx, r.endpoint, keys["outsider"], relay_key)
        stranger.send_multipart([CONTROL, *p.encode(p.RelayOpen("n2"))])
        assert not stranger.poll(500), "a stranger got an answer"
        other = dealer(ctx, r.endpoint, keys["member"], relay_key)
        taken = control(other, p.RelayOpen("n1"))
        assert isinstance(taken, p.Error) and "belongs to another key" in taken.message
        peer = dealer(ctx, opened.endpoint, keys["member"], relay_key)  # members dial the front
        peer.send_multipart(p.encode(p.Ping(3)))
        assert p.decode(recv(node)[1:])[0] == p.Ping(3)
        plain = dealer(ctx, opened.endpoint)  # no CURVE at all: never let in
        plain.send_multipart(p.encode(p.Ping(4)))
        assert not node.poll(500)
    finally:
        r.close()


# --------------------------------------------------------------------------- real processes


def _status_json(cluster) -> dict:
    keys = ["--keys", str(cluster.keys)] if cluster.keys else []
    out = meshnet("status", "--tracker", cluster.endpoint, "--json", *keys)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _relayed_split(cluster, model, relay: str) -> dict:
    """Head and tail both behind the relay: GENERATE, events, FORWARD and TOKEN all cross it."""
    bound = {name: cluster.start_node(name, str(model), layers, None, "--relay", relay)
             for name, layers in (("head", "0-2"), ("tail", "3-5"))}
    cluster.wait_nodes(["head", "tail"], model.name)
    status = _status_json(cluster)
    nodes = {n["id"]: n for n in status["nodes"]}
    for name in ("head", "tail"):
        assert nodes[name]["relayed"] and nodes[name]["relay"] == relay
        assert nodes[name]["endpoint"] != bound[name]  # peers are told the front, never the bound socket
    plan = status["plans"][model.name][0]
    assert [h.get("relay") for h in plan["hops"]] == [relay, relay]
    return status


def _check_tokens(cluster, model, expected: list[int]) -> None:
    with cluster.client() as client:
        assert token_ids(client.generate(model.name, messages=MESSAGES, max_tokens=24)) == expected


@pytest.mark.parametrize("secured", [False, True])
def test_relayed_nodes_serve_the_same_tokens(process_cluster, tiny_models, secured):
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 24)
    if secured:
        process_cluster.secure()
    relay = process_cluster.start_relay()
    _relayed_split(process_cluster, model, relay)
    _check_tokens(process_cluster, model, expected)
    out = meshnet("status", "--tracker", process_cluster.endpoint,
                  *(["--keys", str(process_cluster.keys)] if secured else []))
    assert "(relayed)" in out.stdout and f"relayed via {relay}" in out.stdout


def test_a_killed_relay_drops_the_node_and_a_new_relay_brings_it_back(process_cluster, tiny_models):
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 24)
    relay = process_cluster.start_relay()
    port = int(relay.rsplit(":", 1)[1])
    process_cluster.start_node("head", str(model), "0-2")
    process_cluster.start_node("tail", str(model), "3-5", None, "--relay", relay)
    before = {n["id"]: n for n in process_cluster.wait_nodes(["head", "tail"], model.name)["nodes"]}
    _check_tokens(process_cluster, model, expected)
    process_cluster.kill("relay", signal.SIGKILL)
    with process_cluster.client() as client:  # the node stops heartbeating: the tracker drops it
        assert wait_for(lambda: "tail" not in {n["id"] for n in client.status()["nodes"]}, 20), \
            process_cluster.logs()
    assert process_cluster.procs["tail"].poll() is None, "the relayed node died with its relay"
    process_cluster.start_relay("relay", port)
    after = {n["id"]: n for n in process_cluster.wait_nodes(["head", "tail"], model.name, timeout=60)["nodes"]}
    assert after["tail"]["endpoint"] == before["tail"]["endpoint"]  # the new relay bound the same front
    _check_tokens(process_cluster, model, expected)


def test_fronts_bind_inside_the_port_range_and_a_full_range_is_busy(ctx):
    base = free_port()
    r = RelayThread(ctx, front_ports=(base, base))
    try:
        opened = control(dealer(ctx, r.endpoint), p.RelayOpen("n1"))
        assert opened.endpoint == f"tcp://127.0.0.1:{base}"
        refused = control(dealer(ctx, r.endpoint), p.RelayOpen("n2"))
        assert isinstance(refused, p.Error) and refused.code == p.ErrorCode.BUSY and "no free port" in refused.message
    finally:
        r.close()


def test_a_relay_inside_the_tracker_process(process_cluster, tiny_models):
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 24)
    relay = f"tcp://127.0.0.1:{free_port()}"
    process_cluster.kill("tracker")
    process_cluster._spawn("tracker", "tracker", "--bind", process_cluster.endpoint, "--pub", process_cluster.pub,
                           "--db", str(process_cluster.tmp / "ledger.sqlite3"), "--heartbeat", "0.3",
                           "--relay", relay)
    process_cluster.start_node("solo", str(model), "0-5", None, "--relay", relay)
    nodes = {n["id"]: n for n in process_cluster.wait_nodes(["solo"], model.name)["nodes"]}
    assert nodes["solo"]["relay"] == relay
    _check_tokens(process_cluster, model, expected)


def test_a_route_through_a_relay_that_dies_fails_over_like_any_hop(process_cluster, tiny_models):
    """The relayed hop is a hop like any other to the head's route session: when its relay
    dies mid-generation the head routes around it and the output is unchanged."""
    from tests.test_tracker_processes import hops_of

    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 150)
    relay = process_cluster.start_relay()
    process_cluster.start_node("head", str(model), "0-2")
    process_cluster.start_node("tail1", str(model), "3-5", None, "--relay", relay)
    process_cluster.start_node("tail2", str(model), "3-5")
    status = process_cluster.wait_nodes(["head", "tail1", "tail2"], model.name)
    (via_relay,) = [pl for pl in status["plans"][model.name] if pl["hops"][-1]["node"] == "tail1"]
    got = []
    with process_cluster.client() as client:
        for event in client.generate(model.name, messages=MESSAGES, max_tokens=150, route=hops_of(via_relay)):
            got.extend(event.token_ids)
            if len(got) == 5:
                process_cluster.kill("relay", signal.SIGKILL)
            if event.event == "done":
                assert event.route[-1].node == "tail2"
    assert got == expected
    assert process_cluster.procs["tail1"].poll() is None
