"""A node's links to peers are bounded: the endpoints come from what peers name.

Unit tests drive ``Peers`` over real DEALERs in a context of their own; the flood test
attacks a `meshnet node` process with FORWARDs naming thousands of ``reply_to``
endpoints and counts its open file descriptors while an honest stream runs through it.
"""
from __future__ import annotations

import os
import re
import secrets
import threading
import time
from collections import Counter

import pytest
import torch
import zmq

from fabric.compute.tensors import to_wire
from fabric.net.peer_liveness import PeerLiveness
from fabric.node.peers import MAX_CLOSING, MAX_PEERS, PEER_IDLE_S, Peers
from fabric.wire import protocol as p
from tests.cluster import node_counters
from tests.support import free_port, wait_for
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy

HIDDEN = 64  # tiny_models' hidden size
FDS_PER_LINK = 4  # a DEALER, its monitor and the monitor's other end: three sockets, about three fds
FLOOD = 3000  # distinct reply_to endpoints the attacker names
BURST = 100  # frames it sends before it waits for the node to answer them (its queue has room for 256)


@pytest.fixture
def peers(ctx):
    poller = zmq.Poller()
    made = Peers(ctx, None, poller, Counter(), PeerLiveness(), probe_interval=2.0)
    yield made
    made.close()


def _endpoints(n: int) -> list[str]:
    """``n`` distinct endpoints nothing listens on (their DEALERs keep trying to connect)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return [f"tcp://127.0.0.1:{port}" for port in ports]


def test_idle_links_close_unless_a_session_route_or_probe_needs_them(peers):
    needed, probed, *idle = _endpoints(12)
    peers.probes = {probed: ""}
    for endpoint in (needed, probed, *idle):
        peers.send(endpoint, "", p.encode(p.Ping(1)))
        peers.liveness.link(endpoint, up=False)  # what a link that went down leaves behind
        peers.rtt.ping(endpoint)
    now = time.monotonic()
    peers.prune(now, lambda: {needed})
    assert len(peers.socks) == 12  # nothing idle long enough yet
    peers.prune(now + PEER_IDLE_S + 1, lambda: {needed})
    assert set(peers.socks) == {needed, probed} and set(peers.endpoint_of.values()) == {needed, probed}
    assert len(peers.endpoint_of) == 4 and len(peers.poller.sockets) == 4  # two DEALERs, two monitors
    assert set(peers.liveness._down_since) == {needed, probed} and set(peers.rtt._sent) == {needed, probed}
    assert peers.counters["closed_peers"] == 10


def test_a_flood_of_endpoints_keeps_at_most_max_peers_links_and_the_needed_ones(peers):
    """Past MAX_PEERS a new endpoint takes the place of the least recently used link that
    nothing needs; a needed one, however old, stays."""
    needed, *flood = _endpoints(3 * MAX_PEERS)
    peers.dial(needed, "")
    peers.prune(time.monotonic(), lambda: {needed})
    for i, endpoint in enumerate(flood):
        peers.send(endpoint, "", p.encode(p.Ping(1)))
        assert len(peers.socks) <= MAX_PEERS
        if i % 16 == 15:
            peers.prune(time.monotonic(), lambda: {needed})  # the loop's turn ends: let-go links close
    peers.prune(time.monotonic(), lambda: {needed})
    assert needed in peers.socks and flood[-1] in peers.socks and len(peers.socks) == MAX_PEERS
    assert len(peers.endpoint_of) == 2 * MAX_PEERS
    assert peers.counters["refused_peers"] == 0 and peers.counters["closed_peers"] == len(flood) + 1 - MAX_PEERS


def test_with_every_link_needed_a_new_dial_is_refused_counted_and_harmless(peers):
    endpoints = _endpoints(MAX_PEERS + 2)
    for endpoint in endpoints[:MAX_PEERS]:
        peers.dial(endpoint, "")
    peers.prune(time.monotonic(), lambda: set(endpoints[:MAX_PEERS]))
    peers.dial(endpoints[-2], "")
    peers.send(endpoints[-1], "", p.encode(p.Ping(1)))
    assert set(peers.socks) == set(endpoints[:MAX_PEERS])
    assert peers.counters["refused_peers"] == 2 and peers.counters["dropped_frames"] == 1


def test_links_let_go_in_one_turn_are_bounded_until_it_ends(peers):
    """Sockets let go are closed at the end of the loop's turn (a poll's answer may still
    name them); until then at most MAX_CLOSING links wait, and further dials are refused."""
    endpoints = _endpoints(MAX_PEERS + MAX_CLOSING + 8)
    for endpoint in endpoints:
        peers.dial(endpoint, "")
    assert len(peers.socks) == MAX_PEERS and len(peers.endpoint_of) == 2 * (MAX_PEERS + MAX_CLOSING)
    assert peers.counters["refused_peers"] == 8
    peers.prune(time.monotonic(), set)
    assert len(peers.endpoint_of) == 2 * MAX_PEERS


# --------------------------------------------------------------------------- the flood, on a process


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _frames(i: int, reply_to: str) -> list:
    """A hostile frame naming ``reply_to``: a decode-step FORWARD for a session the node does
    not hold (answered there with CACHE_MISS), or an AUDIT (answered there with its result)."""
    spec, buf = to_wire(torch.zeros(1, 1, HIDDEN))
    if i % 2:
        return p.encode(p.Audit(audit=secrets.token_hex(8), start_layer=3, end_layer=5, reply_to=reply_to,
                                tensors=(spec,)), [buf])
    return p.encode(p.Forward(session=secrets.token_hex(16), step=0, pos=5, start_layer=3, end_layer=5, route=(),
                              reply_to=reply_to, tensors=(spec,)), [buf])


def _attack(endpoint: str, reply_tos: list[str], metrics: int, seen: list[int], pid: int) -> None:
    """Send the hostile frames in bursts of BURST; after each, wait until the node read them
    all (its PONG) and answered them all (its queue is empty, so it never turns honest hops
    away as BUSY), and note its open fds. Appends -1 when every burst was answered."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for start in range(0, len(reply_tos), BURST):
            for i, reply_to in enumerate(reply_tos[start:start + BURST], start):
                sock.send_multipart(_frames(i, reply_to))
            sock.send_multipart(p.encode(p.Ping(start)))
            if not _ponged(sock, start) or not wait_for(lambda: _queued_hops(metrics) == 0, 60):
                return
            seen.append(_open_fds(pid))
        seen.append(-1)
    finally:
        sock.close()


def _ponged(sock: zmq.Socket, nonce: int) -> bool:
    while sock.poll(60_000):
        msg = p.decode(sock.recv_multipart())[0]
        if isinstance(msg, p.Pong) and msg.nonce == nonce:
            return True
    return False


def _queued_hops(port: int) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^meshnet_node_queued_hops\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_what_a_pass_sends_goes_as_one_batch_per_peer_in_order(peers, ctx):
    """Inside ``batched()`` nothing leaves; at its end each peer gets one message: a BATCH of
    its messages in the order sent (at most MAX_BATCH each), or the one message as it was."""
    routers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    ends = [f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}" for r in routers]
    try:
        with peers.batched():
            for i in range(p.MAX_BATCH + 2):
                peers.send(ends[0], "", p.encode(p.Ping(i)))
            peers.send(ends[1], "", p.encode(p.Ping(99)))
            assert not any(r.poll(300) for r in routers)  # held until the pass's results are all out
        got = []
        for _ in range(2):
            assert routers[0].poll(5000)
            got.append([p.decode(body)[0].nonce for body in p.unbatch(routers[0].recv_multipart()[1:])])
        assert got == [list(range(p.MAX_BATCH)), [p.MAX_BATCH, p.MAX_BATCH + 1]]
        assert routers[1].poll(5000)
        alone = routers[1].recv_multipart()[1:]
        assert p.unbatch(alone) == [alone] and p.decode(alone)[0] == p.Ping(99)
        peers.send(ends[1], "", p.encode(p.Ping(7)))  # outside: at once
        assert routers[1].poll(5000) and p.decode(routers[1].recv_multipart()[1:])[0] == p.Ping(7)
    finally:
        for r in routers:
            r.close(linger=0)


def test_a_held_message_sent_with_copy_is_copied(peers, ctx):
    """A buffer handed to ``send`` inside ``batched()`` with copy (the default) may change once
    ``send`` returns: the peer gets the bytes as they were then, BATCH or not."""
    router = ctx.socket(zmq.ROUTER)
    end = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        for count in (1, 2):
            bodies = [[bytearray(frame) for frame in p.encode(p.Ping(i))] for i in range(count)]
            with peers.batched():
                for body in bodies:
                    peers.send(end, "", body)
                    body[-1][:] = bytes(len(body[-1]))  # the caller reuses its buffer
            assert router.poll(5000)
            got = p.unbatch(router.recv_multipart()[1:])
            assert [p.decode(body)[0] for body in got] == [p.Ping(i) for i in range(count)]
    finally:
        router.close(linger=0)


def test_a_node_flooded_with_reply_to_endpoints_keeps_its_fds_bounded_and_serves(process_cluster, tiny_models):
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 12)
    metrics = free_port()
    process_cluster.start_node("a", str(model), "0-2")
    tail = process_cluster.start_node("b", str(model), "3-5", None, "--metrics-port", str(metrics))
    process_cluster.wait_nodes(["a", "b"], model.name)
    pid = process_cluster.procs["b"].pid

    def generate() -> list[int]:
        with process_cluster.client() as client:
            return [t for e in client.generate(model.name, messages=MESSAGES, max_tokens=12) for t in e.token_ids]

    assert generate() == expected
    before = _open_fds(pid)
    seen: list[int] = []
    attacker = threading.Thread(target=_attack, args=(tail, _endpoints(FLOOD), metrics, seen, pid))
    attacker.start()
    during = []
    while attacker.is_alive():
        during.append(generate())
    attacker.join()
    assert seen and seen.pop() == -1, process_cluster.logs()  # the node answered every burst
    assert max(seen) - before <= FDS_PER_LINK * (MAX_PEERS + MAX_CLOSING), (before, seen)
    counters = node_counters(metrics)  # each endpoint was dialed and later closed, or refused
    assert counters["closed_peers"] + counters["refused_peers"] >= FLOOD - MAX_PEERS, counters
    assert during and all(tokens == expected for tokens in during)
    assert generate() == expected
    assert process_cluster.procs["b"].poll() is None
