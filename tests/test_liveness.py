"""Peer liveness and route splicing (pure)."""
from __future__ import annotations

from fabric.liveness import PeerLiveness, splice
from fabric.protocol import Hop


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
