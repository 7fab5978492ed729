"""A node that returns wrong results is caught by audits and excluded, and no answer is wrong.

Real processes: a tracker, two heads (layers 0-2) and three tails (3-5), one of which lies
(tests/liar_node.py: every output it computes is wrong). One head audits every prefill
(``--audit-rate 1``), the other none. What is guaranteed, and checked here: a request whose
prefill is audited on the lying hop streams no token of it (the token is held until the
audit ends; the step re-runs on a route without the liar), and once convicted the liar is
in no plan. A head that audits nothing lets the liar's wrong answer through.
"""
from __future__ import annotations

import msgpack
import zmq

from fabric.compute.models import load_tokenizer, resolve
from fabric.wire.liveness import TOPIC_EVENTS
from fabric.wire.protocol import Hop
from tests.cluster import node_counters
from tests.support import at_once, free_port
from tests.tiny_models import reference_greedy

TOKENS = 24
PROMPTS = ["hello world, how are you today?", "the quick brown fox", "tell me about lighthouses",
           "what is two plus two?"]


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def references(model) -> dict[str, list[int]]:
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


def test_a_lying_tail_is_excluded_and_every_answer_stays_correct(process_cluster, tiny_models, ctx):
    model = tiny_models("llama")
    expected = references(model)
    metrics = free_port()
    process_cluster.start_node("head", str(model), "0-2", None, "--audit-rate", "1", "--metrics-port", str(metrics))
    process_cluster.start_node("trusting", str(model), "0-2", None, "--audit-rate", "0")
    for name in ("t1", "t2"):
        process_cluster.start_node(name, str(model), "3-5")
    process_cluster.start_node("liar", str(model), "3-5", liar=True)
    status = process_cluster.wait_nodes(["head", "trusting", "t1", "t2", "liar"], model.name)
    nodes = {n["id"]: n for n in status["nodes"]}

    def through(head: str, tail: str) -> tuple[Hop, ...]:
        return Hop(head, nodes[head]["endpoint"], 0, 2), Hop(tail, nodes[tail]["endpoint"], 3, 5)

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC_EVENTS)
    sub.connect(process_cluster.pub)
    first = PROMPTS[0]
    # the liar lies: through a head that audits nothing, its answer is wrong (so this test can fail)
    assert generate(process_cluster, model, first, through("trusting", "liar")) != expected[first]

    # through the auditing head, three streams at once on the liar: every answer is right
    answers = at_once(lambda i: generate(process_cluster, model, PROMPTS[i], through("head", "liar")), 3)
    assert answers == {i: expected[PROMPTS[i]] for i in range(3)}

    events = audit_events(sub)
    assert events and all(e["node"] == "liar" and e["code"] == "liar" for e in events), events
    assert set(events[0]["witnesses"]) == {"t1", "t2"} and events[0]["by"] == "head"
    with process_cluster.client() as client:
        status = client.status()
    rows = {n["id"]: n for n in status["nodes"]}
    assert rows["liar"]["excluded"] and not any(rows[n]["excluded"] for n in ("head", "trusting", "t1", "t2"))
    planned = {h["node"] for plan in status["plans"][model.name] for h in plan["hops"]}
    assert "liar" not in planned and {"t1", "t2"} & planned

    # every later request, routed by the tracker through either head, is right and never meets the liar
    def planned_answer(i: int) -> list[int]:
        return generate(process_cluster, model, PROMPTS[i % len(PROMPTS)])

    assert at_once(planned_answer, 4) == {i: expected[PROMPTS[i]] for i in range(4)}
    assert audit_events(sub, timeout=2.0) == []  # honest tails pass their audits: no mismatch, no verdict
    counts = node_counters(metrics, "audits")
    assert counts["audits_convicted"] >= 1 and counts["audits_passed"] >= 1, counts
    assert counts["audits_unsettled"] == 0, counts

