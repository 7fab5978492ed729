"""Registry: registration, validation, heartbeats, expiry (with a fake clock)."""
from __future__ import annotations

import pytest

from fabric.wire.protocol import Heartbeat, ProtocolError, Register
from tracker.registry import Registry


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def register(node_id: str = "a", start: int = 0, end: int = 29, **kw) -> Register:
    fields = dict(node_id=node_id, endpoint=f"tcp://{node_id}:1", model="m", fingerprint="f",
                  num_layers=30, start_layer=start, end_layer=end, benchmark=100.0)
    return Register(**{**fields, **kw})


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry(clock):
    return Registry(heartbeat_interval=1.0, expiry_missed=3, clock=clock)


def test_register_heartbeat_and_load(registry):
    node = registry.register(register(hardware={"gpu": "none"}, max_sessions=2))
    assert node.layers == (0, 29) and node.hardware == {"gpu": "none"}
    assert registry.heartbeat(Heartbeat(node_id="a", sessions=1, queued=4)).queued == 4
    assert registry.get("a").sessions == 1 and not registry.get("a").at_capacity
    assert registry.heartbeat(Heartbeat(node_id="ghost")) is None
    assert registry.models() == ["m"] and len(registry) == 1


def test_expiry_after_the_configured_missed_heartbeats(registry, clock):
    registry.register(register("a"))
    registry.register(register("b"))
    clock.now += 2.0
    registry.heartbeat(Heartbeat(node_id="b"))
    clock.now += 1.5  # a: 3.5 s silent (> 3 intervals), b: 1.5 s
    assert [n.node_id for n in registry.expire()] == ["a"]
    assert [n.node_id for n in registry.snapshot()] == ["b"]
    clock.now = 105.0  # b heard at 102.0: exactly 3 intervals is still alive
    assert registry.expire() == [] and len(registry) == 1
    clock.now += 0.01
    assert [n.node_id for n in registry.expire()] == ["b"]


def test_version_moves_on_topology_changes_only(registry):
    v0 = registry.version
    registry.register(register("a", max_sessions=1))
    v1 = registry.version
    assert v1 > v0
    registry.register(register("a", max_sessions=1))  # an identical re-registration
    registry.heartbeat(Heartbeat(node_id="a", queued=3))  # load alone
    assert registry.version == v1
    registry.heartbeat(Heartbeat(node_id="a", sessions=1))  # now at capacity
    assert registry.version > v1
    v2 = registry.version
    registry.register(register("a", start=10, max_sessions=1))  # new shard
    assert registry.version > v2 and registry.get("a").sessions == 0
    registry.remove("a")
    assert registry.get("a") is None


@pytest.mark.parametrize("bad", [
    dict(node_id=""), dict(model=""), dict(endpoint=""), dict(num_layers=0),
    dict(start_layer=5, end_layer=4), dict(end_layer=30), dict(benchmark=-1.0),
    dict(max_sessions=-1), dict(node_id="x" * 300),
])
def test_invalid_registrations_are_refused(registry, bad):
    with pytest.raises(ProtocolError) as info:
        registry.register(register(**bad))
    assert info.value.code == "bad_request"
    assert len(registry) == 0


def test_invalid_heartbeats_are_refused(registry):
    registry.register(register())
    with pytest.raises(ProtocolError):
        registry.heartbeat(Heartbeat(node_id="a", sessions=-1))


def test_registry_arguments_are_checked():
    with pytest.raises(ValueError):
        Registry(heartbeat_interval=0)
    with pytest.raises(ValueError):
        Registry(expiry_missed=0)
