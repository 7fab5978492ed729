"""What a client leaves behind, and what of it travels: a vanished client's request stops,
and its API key never leaves it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from fabric import Client
from fabric.wire import protocol as p
from tests.cluster import ThreadCluster, wait_for

REPO = Path(__file__).resolve().parents[2]

# a client that asks for a very long answer, says when tokens come, and never cancels
GREEDY_FOREVER = """
import sys
from fabric import Client
with Client(sys.argv[1], timeout=60) as client:
    for n, event in enumerate(client.generate(sys.argv[2], prompt="the quick brown fox", max_tokens=8000,
                                              ignore_eos=True)):
        if n == 4:
            print("streaming", flush=True)
"""


def test_a_client_that_vanishes_stops_its_request(tiny_models):
    """kill -9 of a client mid-stream: its head cancels the request at the next event it cannot
    deliver, long before the 8,000 tokens it asked for, and the hops free the session."""
    model = tiny_models("llama")
    cluster = ThreadCluster()
    try:
        head = cluster.add_node(model, 0, 2, 6, "h")
        tail = cluster.add_node(model, 3, 5, 6, "t")
        cluster.wait_routable(model.name, 2)
        proc = subprocess.Popen([sys.executable, "-c", GREEDY_FOREVER, cluster.endpoint, model.name], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.readline().strip() == "streaming"
        assert len(head.head.sessions) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_for(lambda: not head.head.sessions, 20, 0.05), "the head still generates for a dead client"
        assert wait_for(lambda: len(tail.kv) == 0, 20, 0.05)
        assert head.counters["hops"] < 8000
    finally:
        cluster.close()


def test_api_keys_leave_the_client_only_as_their_id():
    """The GENERATE a head receives carries the key's id, and no byte of the key."""
    ctx = zmq.Context.instance()
    head = ctx.socket(zmq.ROUTER)
    port = head.bind_to_random_port("tcp://127.0.0.1")
    route = (p.Hop("h", f"tcp://127.0.0.1:{port}", 0, 5),)
    sent = threading.Thread(target=_ask, args=(route,), daemon=True)
    sent.start()
    try:
        assert head.poll(10_000)
        frames = head.recv_multipart()
        msg, _ = p.decode(frames[1:])
        assert isinstance(msg, p.Generate) and msg.api_key == p.key_id("sk-very-secret")
        assert msg.api_key.startswith("sha256:") and not any(b"sk-very-secret" in f for f in frames)
    finally:
        head.close(linger=0)


def _ask(route) -> None:
    with Client("tcp://127.0.0.1:1", timeout=2) as client:
        try:
            for _ in client.generate("m", prompt="hi", max_tokens=2, api_key="sk-very-secret", route=route):
                pass
        except Exception:  # nobody answers: the test read what was sent
            time.sleep(0)
