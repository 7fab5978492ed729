"""Peer liveness and route splicing (pure)."""
from __future__ import annotations

import pytest

from fabric.net.peer_liveness import PeerLiveness, splice
from fabric.wire.protocol import Hop


def test_a_busy_peer_is_not_dead_until_it_is_silent_for_long():
    live = PeerLiveness(interval=0.25, silence=10.0, grace=0.25)
    assert live.watch(["a"], now=0.0) == ["a"]
    assert live.watch(["a"], now=0.1) == []  # not due yet
    assert live.watch(["a"], now=0.3) == ["a"]
    assert live.dead(["a"], now=5.0) == set()  # computing a long prefill, link up: alive
    assert live.dead(["a"], now=10.5) == {"a"}  # ten seconds of silence: hung or cut off
    live.seen("a", now=10.6)
    assert live.dead(["a"], now=10.7) == set()


def test_a_dropped_link_means_dead_after_a_short_grace():
    live = PeerLiveness(grace=0.25)
    live.watch(["a", "b"], now=0.0)
    live.link("a", up=False, now=1.0)
    assert live.dead(["a", "b"], now=1.1) == set()  # a reconnect may still come
    assert live.dead(["a", "b"], now=1.3) == {"a"}
    live.link("a", up=True, now=1.4)
    assert live.dead(["a", "b"], now=1.5) == set()


def test_forget_drops_peers_no_route_uses():
    live = PeerLiveness()
    live.watch(["a", "b"], now=0.0)
    live.forget(["a"])
    assert live.watch(["b"], now=0.01) == ["b"]  # b starts afresh


def test_splice_keeps_the_head_and_continues_after_it():
    head = Hop("h", "tcp://h", 0, 14, key="hk")
    plan = (Hop("x", "tcp://x", 0, 20, key="xk"), Hop("y", "tcp://y", 21, 29, key="yk"))
    assert splice(head, plan) == (head, Hop("x", "tcp://x", 15, 20, key="xk"), Hop("y", "tcp://y", 21, 29, key="yk"))
    assert splice(head, (Hop("z", "tcp://z", 0, 29, key="zk"),)) == (head, Hop("z", "tcp://z", 15, 29, key="zk"))
    assert splice(head, (head, Hop("y", "tcp://y", 15, 29))) == (head, Hop("y", "tcp://y", 15, 29))


def test_splice_never_puts_the_head_on_its_route_twice():
    """The head ran layers 0-7 beside b (8-14), now gone; the plan has the head's node whole:
    the head's hop takes 0-14 (one KV per session per node), not 0-7 then 8-14."""
    head = Hop("h", "tcp://h", 0, 7)
    whole = splice(head, (Hop("h", "tcp://h", 0, 14), Hop("t", "tcp://t", 15, 29)))
    assert whole == (Hop("h", "tcp://h", 0, 14), Hop("t", "tcp://t", 15, 29))
    around = splice(head, (Hop("a", "tcp://a", 0, 5), Hop("h", "tcp://h", 6, 14), Hop("t", "tcp://t", 15, 29)))
    assert around == (Hop("h", "tcp://h", 0, 14), Hop("t", "tcp://t", 15, 29))


def test_round_trips_skip_the_handshake_damp_stalls_and_smooth():
    from fabric.net.peer_liveness import RttTable

    rtt = RttTable(alpha=0.5)
    nonce = rtt.ping("tcp://b:1", now=0.0)
    assert rtt.pong("tcp://b:1", nonce, "b", now=0.3) is None  # the first PONG waited for the handshake
    assert rtt.snapshot(now=0.3) == {}
    for t in (1.0, 2.0):
        nonce = rtt.ping("tcp://b:1", now=t)
        assert rtt.pong("tcp://b:1", nonce, "b", now=t + 0.010) == pytest.approx(10.0)
    assert rtt.snapshot(now=2.1) == {"b": pytest.approx(10.0)}
    nonce = rtt.ping("tcp://b:1", now=3.0)
    rtt.ping("tcp://b:1", now=3.1)  # a newer PING replaces it: the late PONG is no sample
    assert rtt.pong("tcp://b:1", nonce, "b", now=3.2) is None
    nonce = rtt.ping("tcp://b:1", now=4.0)
    assert rtt.pong("tcp://b:1", nonce, "b", now=4.5) == pytest.approx(500.0)  # the peer was computing
    assert rtt.snapshot(now=4.5)["b"] == pytest.approx(15.0)  # capped at 2 x 10 ms, then averaged
    assert rtt.pong("tcp://b:1", nonce, "b", now=4.6) is None  # answered already
    assert rtt.snapshot(now=100.0) == {}  # no sample for a minute: forgotten
    rtt.relinked("tcp://b:1")
    nonce = rtt.ping("tcp://b:1", now=101.0)
    assert rtt.pong("tcp://b:1", nonce, "b", now=101.2) is None  # a reconnect's handshake again


def test_drop_forgets_every_trace_of_a_closed_link():
    live = PeerLiveness(grace=0.25)
    live.watch(["a", "b"], now=0.0)
    live.link("a", up=False, now=1.0)
    live.drop("a")
    assert live.dead(["a"], now=100.0) == set()  # nothing known: not taken for dead, nor kept
    assert live._last_seen.keys() == live._last_ping.keys() == {"b"} and live._down_since == {}


def test_round_trips_keep_a_bounded_number_of_peers_whatever_they_call_themselves():
    """A peer names itself in each PONG: one that answers with a new name every time must
    not grow the table; endpoints go with their link (``drop``)."""
    from fabric.net.peer_liveness import RttTable

    rtt = RttTable(max_nodes=8)
    rtt._linked.add("tcp://liar:1")  # past the handshake: each PONG is a sample
    for i in range(100):
        nonce = rtt.ping("tcp://liar:1", now=float(i))
        assert rtt.pong("tcp://liar:1", nonce, f"name-{i}", now=i + 0.01) == pytest.approx(10.0)
    assert len(rtt._ms) == len(rtt._recent) == len(rtt._updated) == 8
    assert set(rtt.snapshot(now=100.0)) == {f"name-{i}" for i in range(92, 100)}  # the freshest stay
    rtt.ping("tcp://liar:1", now=101.0)
    rtt.drop("tcp://liar:1")
    assert rtt._sent == {} and rtt._linked == set()
