"""A node that returns wrong results is caught by audits and excluded, and nobody else is.

Real processes: a tracker, two heads (layers 0-2) and three tails (3-5), one of which lies
(tests/liar_node.py): on decode steps only (its prefills honest, so an audit of prompts alone
never sees it), or on every step. One head audits every request (``--audit-rate 1``), the
other none. A rogue process meanwhile sends forged AUDIT_TAP and AUDIT_RESULT frames to the
auditing head and a forged VERDICT against an honest tail to the tracker, over real sockets.
What is checked: the liar is convicted by two honest replicas that agree, published with its
evidence and left out of every plan; the rogue's frames change nothing; honest streams are
token for token what a single process computes, audits on or off.
"""
from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from fabric.compute.models import load_tokenizer, resolve
from fabric.compute.tensors import to_wire
from fabric.wire import protocol as p
from fabric.wire.liveness import TOPIC_EVENTS
from fabric.wire.protocol import Hop
from fabric.node import replica_watch
from fabric.node.taps import Taps
from tests.cluster import node_counters
from tests.support import at_once, free_port, wait_for

TOKENS = 24
PROMPTS = ["hello world, how are you today?", "the quick brown fox", "tell me about lighthouses",
           "what is two plus two?"]


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def references(model) -> dict[str, list[int]]:
    from tests.tiny_models import reference_greedy

    tok = load_tokenizer(resolve(str(model)))
    ids = {c: list(tok.apply_chat_template(chat(c), add_generation_prompt=True, tokenize=True, return_dict=False))
           for c in PROMPTS}
    return {c: reference_greedy(model, i, TOKENS) for c, i in ids.items()}


def generate(cluster, model, content: str, route: tuple[Hop, ...] | None = None) -> list[int]:
    with cluster.client() as client:
        events = client.generate(model.name, messages=chat(content), max_tokens=TOKENS, route=route)
        return [t for e in events for t in e.token_ids]


def audit_events(sub: zmq.Socket, timeout: float = 10.0) -> list[dict]:
    """The ``audit`` events published on the feed until ``timeout`` passes without one."""
    found = []
    while sub.poll(timeout * 1000):
        topic, payload = sub.recv_multipart()
        event = msgpack.unpackb(payload)
        if topic == TOPIC_EVENTS and event["kind"] == "audit":
            found.append(event)
            timeout = 1.0  # others of the same verdict follow at once
    return found


def forge(ctx: zmq.Context, head: str, tracker: str, model: str) -> p.Message:
    """A rogue's frames: taps and results nobody asked for, to the head; a verdict against t1 by
    an audit that never ran, to the tracker (its answer is returned)."""
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    rogue.connect(head)
    (inp, inp_buf), (out, out_buf) = to_wire(torch.ones(3, p.SKETCH_DIM)), to_wire(torch.ones(1, p.SKETCH_DIM))
    logits, logits_buf = to_wire(torch.ones(1, 320))  # (n, vocab)
    for n in range(5):
        tap = p.AuditTap(f"{n:032x}", f"rogue-{n}", 0, 0, 3, 5, token=1, tensors=(inp, out))
        rogue.send_multipart(p.encode(tap, [inp_buf, out_buf]))
        rogue.send_multipart(p.encode(p.AuditResult(f"{n:032x}", tensors=(logits,)), [logits_buf]))
    rogue.close(linger=5000)  # the frames go out before the socket does
    liar = ctx.socket(zmq.DEALER)
    liar.linger = 0
    liar.connect(tracker)
    liar.send_multipart([b"", *p.encode(p.Verdict("head", model, "t1", 3, 5, witnesses=("t2", "liar"),
                                                  settled=True, detail="made up"))])
    assert liar.poll(10_000), "the tracker did not answer"
    answer, _ = p.decode(p.split_envelope(liar.recv_multipart())[1])
    liar.close()
    return answer


@pytest.mark.parametrize("lie", ["decode", "all"])
def test_a_lying_tail_is_excluded_and_nobody_else(process_cluster, tiny_models, ctx, lie):
    model = tiny_models("llama")
    expected = references(model)
    metrics = free_port()
    process_cluster.start_node("head", str(model), "0-2", None, "--audit-rate", "1", "--metrics-port", str(metrics))
    process_cluster.start_node("trusting", str(model), "0-2", None, "--audit-rate", "0")
    for name in ("t1", "t2"):
        process_cluster.start_node(name, str(model), "3-5")
    process_cluster.start_node("liar", str(model), "3-5", liar=lie)
    status = process_cluster.wait_nodes(["head", "trusting", "t1", "t2", "liar"], model.name)
    nodes = {n["id"]: n for n in status["nodes"]}

    def through(head: str, tail: str) -> tuple[Hop, ...]:
        return Hop(head, nodes[head]["endpoint"], 0, 2), Hop(tail, nodes[tail]["endpoint"], 3, 5)

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC_EVENTS)
    sub.connect(process_cluster.pub)
    refused = forge(ctx, nodes["head"]["endpoint"], process_cluster.endpoint, model.name)
    # refused twice over: not from the connection that registered the head (a plaintext swarm),
    # and citing no replica the tracker named to it
    assert isinstance(refused, p.Error) and "not registered on this connection" in refused.message, refused

    first = PROMPTS[0]
    # the liar lies: through a head that audits nothing, its answer is wrong (so this test can fail)
    assert generate(process_cluster, model, first, through("trusting", "liar")) != expected[first]
    # honest streams through the auditing head are unchanged by the taps every step sends
    assert generate(process_cluster, model, PROMPTS[1], through("head", "t1")) == expected[PROMPTS[1]]

    # three streams at once through the auditing head and the liar: their replays convict it
    at_once(lambda i: generate(process_cluster, model, PROMPTS[i], through("head", "liar")), 3)
    events = audit_events(sub)
    assert events and all(e["node"] == "liar" for e in events), events  # as a replica too, only it is named
    convictions = [e for e in events if e["code"] == "liar"]
    assert convictions and set(convictions[0]["witnesses"]) == {"t1", "t2"} and convictions[0]["by"] == "head"
    assert convictions[0]["lapses_in"] > 0 and "positions apart" in convictions[0]["detail"]
    with process_cluster.client() as client:
        status = client.status()
    rows = {n["id"]: n for n in status["nodes"]}
    assert "t1 and t2" in rows["liar"]["excluded"] or "t2 and t1" in rows["liar"]["excluded"]
    assert not any(rows[n]["excluded"] for n in ("head", "trusting", "t1", "t2"))
    planned = {h["node"] for plan in status["plans"][model.name] for h in plan["hops"]}
    assert "liar" not in planned and {"t1", "t2"} & planned

    # every later request, routed by the tracker or through the auditing head, is right and never meets the liar
    def planned_answer(i: int) -> list[int]:
        return generate(process_cluster, model, PROMPTS[i % len(PROMPTS)], None if i < 2 else through("head", "t2"))

    assert at_once(planned_answer, 4) == {i: expected[PROMPTS[i]] for i in range(4)}
    assert audit_events(sub, timeout=3.0) == []  # honest tails pass their replays: no mismatch, no verdict
    counts = node_counters(metrics, "audit")
    assert counts["audits_convicted"] >= 1 and counts["audits_passed"] >= 1, counts
    assert counts["audits_unsettled"] == 0 and counts["audit_frames_ignored"] >= 10, counts


def test_a_split_nobody_could_check_taps_nothing_until_a_replica_joins(thread_cluster, tiny_models, monkeypatch):
    """`meshnet up`'s split: the tracker knows no other copy of the tail's layers, so no audit could
    check it, and its taps (a frame and two sketches a step) would be read by nobody. After the
    head's first request asks the tracker, the tail taps nothing; once a replica joins, the next
    question finds it and the tails tap again. The text is the same throughout."""
    monkeypatch.setattr(replica_watch, "RECHECK_S", 0.5)
    tapped = []  # the tap id of every step a hop tapped (a step's tap goes after its TOKEN: it may come late)
    real_tap = Taps.tap

    def tap(self, work, result, tokens=None):
        tapped.append(work.msg.audit)
        return real_tap(self, work, result, tokens)

    monkeypatch.setattr(Taps, "tap", tap)
    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head", audit_rate=1.0)
    thread_cluster.add_node(model, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model.name, 2)
    first = generate(thread_cluster, model, PROMPTS[0])
    assert tapped  # nobody had asked yet: tapped
    assert wait_for(lambda: head.head.auditor.watch.questions == {})  # answered: nobody
    assert generate(thread_cluster, model, PROMPTS[0]) == first
    assert set(tapped) == {tapped[0]}  # every tap the first request's: the second asked for none
    assert head.counters["audits_untapped"] == 1
    thread_cluster.add_node(model, 3, 5, 6, "tail2")
    thread_cluster.wait_routable(model.name, 3)
    assert wait_for(lambda: generate(thread_cluster, model, PROMPTS[0]) == first and len(set(tapped)) > 1, 10)
