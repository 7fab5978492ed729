"""scripts/raw_protocol.py, the plain-pyzmq example of docs/PROTOCOL.md, against a loopback
cluster: it streams tokens, and its CANCEL ends the request on every hop. Also the example
payloads of the tracker's PUB topics in that document, against what a tracker publishes."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import msgpack
import zmq

from tests.cluster import ROOT, ThreadCluster, wait_sessions_zero

SCRIPT = ROOT / "scripts" / "raw_protocol.py"
DOC = ROOT / "docs" / "PROTOCOL.md"
TOPICS = (b"plans", b"stats", b"events")


def _doc_block(title: str) -> str:
    """The fenced block of docs/PROTOCOL.md whose first line is ``title``, title included."""
    m = re.search(r"```[a-z]*\n(" + re.escape(title) + r"\n.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert m, f"no code block starting with {title!r} in {DOC}"
    return m.group(1)


def _split(cluster: ThreadCluster, model_dir) -> list:
    nodes = [cluster.add_node(model_dir, 0, 2, 6, "a"), cluster.add_node(model_dir, 3, 5, 6, "b")]
    cluster.wait_routable(model_dir.name, 2)
    return nodes


def _run_script(cluster: ThreadCluster, model: str, *extra: str) -> list[str]:
    out = subprocess.run([sys.executable, str(SCRIPT), cluster.endpoint, model, *extra],
                         capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_document_quotes_the_script():
    script = SCRIPT.read_text(encoding="utf-8")
    assert _doc_block(script.splitlines()[0]) == script


def test_the_script_streams_tokens_then_cancel_ends_the_request(thread_cluster, tiny_models):
    model_dir = tiny_models("llama")
    nodes = _split(thread_cluster, model_dir)
    lines = _run_script(thread_cluster, model_dir.name, "Hello there", "--cancel-after", "3")
    assert lines[0] == "route: a[0-2] -> b[3-5]"
    assert lines[1].startswith("start ")
    cancel = lines.index("sent CANCEL")
    assert [line.startswith("token [") for line in lines[2:cancel]] == [True] * 3
    after = lines[cancel + 1:]
    assert after[-1].startswith("done finish_reason=cancelled error_code=None"), lines
    streamed = int(re.search(r"completion_tokens=(\d+)", after[-1]).group(1))
    assert 3 <= streamed <= 5 and len(after) - 1 == streamed - 3  # at most the steps in flight, not 256
    wait_sessions_zero([n.endpoint for n in nodes], timeout=2.0)  # every hop freed the session


def _publications(sub: zmq.Socket, until: float) -> list[tuple[str, dict]]:
    seen = []
    while time.monotonic() < until:
        if sub.poll(100):
            topic, payload = sub.recv_multipart()
            seen.append((topic.decode(), msgpack.unpackb(payload)))
    return seen


def _documented(title: str) -> dict:
    return json.loads(_doc_block(title).split("\n", 1)[1])


def _keys(name: str, payload: dict) -> dict[str, list[str]]:
    """The field names of a publication, and of the rows inside it that have fixed fields."""
    rows = {name: payload}
    if name == "plans":
        route = next(iter(payload["plans"].values()))[0]
        rows.update(route=route, hop=route["hops"][0])
    elif name == "stats":
        rows.update(stats=payload["stats"], node=payload["nodes"][0], totals=payload["usage"]["totals"])
    return {row: sorted(fields) for row, fields in rows.items()}


def test_pub_topics_carry_the_documented_payloads(thread_cluster, tiny_models):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    for topic in TOPICS:
        sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(thread_cluster.tracker.pub_endpoint)
    try:
        time.sleep(0.3)  # a SUB hears only what is published after it joined
        model_dir = tiny_models("llama")
        _split(thread_cluster, model_dir)
        _run_script(thread_cluster, model_dir.name, "--cancel-after", "2")
        seen = _publications(sub, time.monotonic() + 4.5)  # stats come every 2 s
    finally:
        sub.close(linger=0)
    latest = {}
    for topic, payload in seen:
        if topic != "events" or payload["kind"] != "error":  # error events differ by cause: not compared
            latest[topic if topic != "events" else f"events {payload['kind']}"] = payload
    latest["stats"] = next(p for t, p in reversed(seen) if t == "stats" and p["nodes"])
    latest["plans"] = next(p for t, p in reversed(seen) if t == "plans" and p["plans"].get(model_dir.name))
    assert {"plans", "stats", "events route selected", "events connected", "events complete"} <= set(latest)
    for name, payload in latest.items():
        assert _keys(name, payload) == _keys(name, _documented(f"# {name}"))
