"""Floods that end: a node or tracker process stopped (Ctrl-C) while a stranger floods it with
fuzzed frames (tests/adversary/test_fuzzed_fields.py's mutants, read by nobody) exits cleanly,
with code 0 and nothing logged worse than a warning, whatever still waits unread in its sockets
and in ZeroMQ's queues; and a node outlives a stranger that fills its queue and leaves."""
from __future__ import annotations

import random
import signal
import threading
import time

import zmq

from tests.adversary.test_fuzzed_fields import mutants, send_to_all
from tests.cluster import ping

FLOOD_S = 4.0  # how long the flood runs before the processes get their SIGINT


def flood(endpoints: list[str], stop: threading.Event) -> int:
    """Send mutants to every endpoint, round after round, until ``stop``: the count sent.
    Answers are read and dropped; a full queue drops the mutant (the sender never blocks)."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in endpoints]
    for sock, endpoint in zip(socks, endpoints):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
    sent = 0
    try:
        while not stop.is_set():
            for _, frames in mutants(random.Random(sent)):
                if stop.is_set():
                    break
                send_to_all(socks, frames, sent, zmq.NOBLOCK)
                sent += 1
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
    return sent


def test_processes_stopped_under_a_flood_exit_cleanly(tiny_models, process_cluster):
    model, c = tiny_models("llama"), process_cluster
    endpoints = [c.start_node("a", str(model), "0-2"), c.start_node("b", str(model), "3-5"), c.endpoint]
    c.wait_nodes(["a", "b"], model.name)
    stop, sent = threading.Event(), []
    flooder = threading.Thread(target=lambda: sent.append(flood(endpoints, stop)))
    flooder.start()
    try:
        time.sleep(FLOOD_S)
        procs = {name: c.procs.pop(name) for name in ("a", "b", "tracker")}
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        codes = {name: proc.wait(30) for name, proc in procs.items()}
    finally:
        stop.set()
        flooder.join()
    logs = c.logs()
    assert codes == {"a": 0, "b": 0, "tracker": 0}, (codes, logs)
    assert sent[0] > 100
    assert not any(word in logs for word in ("Traceback", "Assertion", "ERROR", "Fatal")), logs
    assert "tracker stopped" in logs and logs.count("node stopped") == 2


def test_a_stranger_that_fills_a_node_s_queue_and_leaves_cannot_crash_it(tiny_models, process_cluster):
    """Frames cheaper to send than to reject (one byte each) fill the node's receive queue; the
    stranger then closes its connection. With ZeroMQ's heartbeat on the node's ROUTER (libzmq
    4.3.5) the next heartbeat aborted the process ("Assertion failed: !_io_error"), within two
    such rounds here. The node must live, answer, and log the flood in a few lines."""
    model, c = tiny_models("llama"), process_cluster
    endpoint = c.start_node("a", str(model), "0-5")
    c.wait_nodes(["a"], model.name)
    ctx = zmq.Context()
    try:
        for _ in range(4):
            stranger = ctx.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.setsockopt(zmq.SNDHWM, 0)
            stranger.connect(endpoint)
            until = time.monotonic() + 0.5
            while time.monotonic() < until:
                stranger.send(b"\0", zmq.NOBLOCK)
            stranger.close()
            time.sleep(0.5)  # heartbeats would have fired on the closed connection by now
            assert c.procs["a"].poll() is None, c.logs()
    finally:
        ctx.term()
    assert ping(endpoint, timeout=10) is not None
    log = (c.tmp / "a.log").read_text()
    assert log.count("rejected frame from") <= 5 * 4 and log.count("is not reading") <= 5 * 4, log[-2000:]
    assert "more frames rejected: counted, and not logged one by one" in log, log[-2000:]
