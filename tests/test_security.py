"""A secured swarm (CurveZMQ + ZAP allow-list): strangers get nothing in, and nothing
readable crosses the wire."""
from __future__ import annotations

import shutil

import pytest
import torch
import zmq

from fabric import FabricError
from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.net.security import create_keys, dial_securely, load
from fabric.wire import protocol as p
from fabric.wire.shard import Shard
from tests.cluster import ThreadCluster, free_port
from tests.tcp_tap import TcpTap
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.tiny_models import reference_greedy

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def keys(tmp_path):
    """A swarm key set (also the tracker's), a second member, and an outsider."""
    swarm, member, outsider = tmp_path / "swarm", tmp_path / "member", tmp_path / "outsider"
    create_keys(swarm, "swarm", tracker=True)
    create_keys(member, "member")
    create_keys(outsider, "outsider")
    shutil.copy(member / "id.key", swarm / "allowed" / "member.key")  # the swarm admits member
    for d in (member, outsider):
        shutil.copy(swarm / "id.key", d / "allowed" / "tracker.key")
    return load(swarm), load(member), load(outsider)


def secured_cluster(keys, model_dir, tail_advertise=None, head_advertise=None):
    cluster = ThreadCluster(security=keys[0])
    head = cluster.add_node(model_dir, 0, 2, 6, "head", security=keys[0], **head_advertise or {})
    tail = cluster.add_node(model_dir, 3, 5, 6, "tail", security=keys[0], **tail_advertise or {})
    cluster.wait_routable(model_dir.name, 2)
    return cluster, head, tail


def test_secured_swarm_generates_the_same_tokens(keys, tiny_models):
    model = tiny_models("llama")
    cluster, _, _ = secured_cluster(keys, model)
    try:
        with cluster.client() as client:
            events = list(client.generate(model.name, messages=MESSAGES, max_tokens=16))
        assert [t for e in events for t in e.token_ids] == reference_greedy(model, prompt_ids(model), 16)
    finally:
        cluster.close()


def test_strangers_can_neither_ask_register_nor_inject(keys, tiny_models):
    model = tiny_models("llama")
    swarm, member, outsider = keys
    cluster, head, _ = secured_cluster(keys, model)
    try:
        with cluster.client(security=outsider) as client:
            client.timeout = 1.0
            with pytest.raises(FabricError, match="did not answer"):
                client.status()
            with pytest.raises(FabricError, match="did not answer"):
                client.ask(p.Register("intruder", "tcp://127.0.0.1:1", model.name, "f", 6, 0, 5))
        for security in (outsider, None):  # a stranger's key, and no CURVE at all
            assert not _pong(head.endpoint, security, swarm.public)
        assert _pong(head.endpoint, member, swarm.public)  # an allow-listed member is let in
        with cluster.client() as client:
            assert "intruder" not in {n["id"] for n in client.status()["nodes"]}
    finally:
        cluster.close()


def test_a_member_cannot_claim_another_nodes_id(keys, tiny_models):
    model = tiny_models("llama")
    cluster, head, _ = secured_cluster(keys, model)
    try:
        with cluster.client(security=keys[1]) as client:
            reply = client.ask(p.Register("head", "tcp://127.0.0.1:1", model.name, head.fingerprint, 6, 0, 5))
            assert isinstance(reply, p.Error) and "belongs to another key" in reply.message
            beat = client.ask(p.Heartbeat("head"))
            assert isinstance(beat, p.Error) and "belongs to another key" in beat.message
        with cluster.client() as client:
            nodes = {n["id"]: n for n in client.status()["nodes"]}
        assert nodes["head"]["endpoint"] == head.endpoint
    finally:
        cluster.close()


@pytest.mark.parametrize("secured", [True, False])
def test_traffic_is_encrypted_on_the_wire(keys, tiny_models, secured):
    """Taps in front of the head and the tail record every byte: with keys, neither the
    prompt nor the hidden states appear; without keys they do (so the check can fail)."""
    model = tiny_models("llama")
    hidden = _head_hidden_bytes(model)
    taps: list[TcpTap] = []
    cluster = ThreadCluster(security=keys[0] if secured else None)
    try:
        ports = [free_port(), free_port()]
        taps = [TcpTap(port) for port in ports]
        security = {"security": keys[0]} if secured else {}
        for (name, a, b), port, tap in zip((("head", 0, 2), ("tail", 3, 5)), ports, taps):
            cluster.add_node(model, a, b, 6, name, bind=f"tcp://127.0.0.1:{port}", advertise=tap.endpoint,
                             **security)
        cluster.wait_routable(model.name, 2)
        with cluster.client() as client:
            list(client.generate(model.name, prompt=PROMPT, max_tokens=8))
        wire = b"".join(bytes(t.captured) for t in taps)
        assert len(wire) > len(hidden)  # the taps did carry the traffic
        assert (PROMPT.encode() in wire) is not secured
        assert (hidden in wire) is not secured
    finally:
        cluster.close()
        for tap in taps:
            tap.close()


def _head_hidden_bytes(model_dir) -> bytes:
    """The first 64 bytes of the hidden states the head sends for PROMPT."""
    from fabric.compute.models import load_tokenizer

    source = resolve(str(model_dir))
    ids = load_tokenizer(source)(PROMPT)["input_ids"]
    ex = ShardExecutor(load_shard(source, Shard(0, 2, 6), progress=False), KVStore())
    hidden = ex.run("probe", 0, 2, torch.tensor([ids]), 0).hidden
    return hidden.contiguous().view(-1).view(torch.uint8).numpy().tobytes()[:64]


def _pong(endpoint: str, security, server_key: bytes) -> bool:
    """Whether a PING from a DEALER with ``security`` is answered. A refused handshake may leave
    the DEALER with no pipe to queue the PING in, and its send would block for ever: that, too,
    is no answer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    try:
        dial_securely(sock, security, server_key)
        sock.connect(endpoint)
        try:
            sock.send_multipart(p.encode(p.Ping(5)))
        except zmq.Again:
            return False
        return bool(sock.poll(1000)) and isinstance(p.decode(sock.recv_multipart())[0], p.Pong)
    finally:
        sock.close()

