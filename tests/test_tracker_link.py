"""A node's link to the tracker says plainly when the tracker is silent, refuses, or needs keys.

Unit tests drive ``TrackerLink`` with a fake clock over real sockets; process tests start a
real ``meshnet node`` against a tracker that is not there yet, and against a secured tracker
without keys, and read what the node logs.
"""
from __future__ import annotations

import logging
import re
import time

import zmq

from fabric.net.security import create_keys, load, serve_securely, start_authenticator
from fabric.net.tracker_link import TrackerLink
from fabric.wire import protocol as p
from tests.support import FakeClock, free_port, wait_for

WARN = "does not answer"
NEEDS_KEYS = "requires CurveZMQ keys (start with --keys DIR"




def messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_silent_tracker_is_named_after_the_silence_and_again_later(ctx, caplog):
    clock, endpoint = FakeClock(), f"tcp://127.0.0.1:{free_port()}"
    link = TrackerLink(ctx, endpoint, None, silence=5.0, repeat=60.0, clock=clock)
    try:
        with caplog.at_level(logging.INFO, logger="fabric.node"):
            link.check()
            assert link.send(p.Heartbeat("n"))
            clock.now += 4.9
            link.check()
            assert messages(caplog, WARN) == []
            clock.now += 0.2
            link.check()
            clock.now += 30
            link.check()
            warned = messages(caplog, WARN)
            assert len(warned) == 1 and endpoint in warned[0] and "--tracker" in warned[0]
            clock.now += 31
            link.check()
            assert len(messages(caplog, WARN)) == 2
            link.answered(p.Ack())
            assert messages(caplog, "answers now") == [f"the tracker at {endpoint} answers now"]
            clock.now += 100
            link.check()  # nothing sent since the answer: nothing to wait for
            assert len(messages(caplog, WARN)) == 2
    finally:
        link.close()


def test_a_refusal_is_logged_once_per_reason(ctx, caplog):
    link = TrackerLink(ctx, f"tcp://127.0.0.1:{free_port()}", None)
    try:
        with caplog.at_level(logging.INFO, logger="fabric.node"):
            bad = p.Error(code=p.ErrorCode.BAD_REQUEST, message="fingerprint too long")
            for _ in range(3):
                link.answered(bad)
            link.answered(p.Error(code=p.ErrorCode.UNKNOWN_NODE, message="register again"))  # the node handles it
            link.answered(p.Error(code=p.ErrorCode.BAD_REQUEST, message="another reason"))
        refused = messages(caplog, "refused this node")
        assert len(refused) == 2 and "fingerprint too long (bad_request)" in refused[0]
    finally:
        link.close()


def test_a_node_without_keys_is_told_the_tracker_needs_them(ctx, caplog, tmp_path):
    create_keys(tmp_path / "keys", "tracker", tracker=True)
    security = load(tmp_path / "keys")
    auth = start_authenticator(ctx, security)
    server = ctx.socket(zmq.ROUTER)
    serve_securely(server, security)
    endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    link = TrackerLink(ctx, endpoint, None)
    try:
        with caplog.at_level(logging.INFO, logger="fabric.node"):
            deadline = time.monotonic() + 30  # a loaded machine handshakes slowly
            while not messages(caplog, NEEDS_KEYS) and time.monotonic() < deadline:
                if link.monitor.poll(100):
                    link.on_monitor(link.monitor.recv_multipart())
                link.send(p.Heartbeat("n"))
            for _ in range(5):  # the same failure again: nothing new is said
                link.send(p.Heartbeat("n"))
                if link.monitor.poll(50):
                    link.on_monitor(link.monitor.recv_multipart())
        assert messages(caplog, NEEDS_KEYS) == [f"the tracker at {endpoint} {NEEDS_KEYS}; see `meshnet keys --help`)"]
        assert len(messages(caplog, "not reading")) <= 1
    finally:
        link.close()
        server.close(linger=0)
        auth.stop()


# --------------------------------------------------------------------------- real processes


def log_lines(cluster, name: str) -> list[str]:
    path = cluster.tmp / f"{name}.log"
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def test_a_node_warns_within_seconds_that_its_tracker_is_silent_then_joins(process_cluster, tiny_models):
    cluster, model = process_cluster, tiny_models("llama")
    cluster.kill("tracker")  # the node dials a tracker nobody runs (yet)
    cluster.start_node("lonely", str(model), "0-5")
    assert wait_for(lambda: any("serving layers" in line for line in log_lines(cluster, "lonely")), 60, 0.1), \
        cluster.logs()
    served = time.monotonic()
    assert wait_for(lambda: any(WARN in line for line in log_lines(cluster, "lonely")), 10, 0.1), cluster.logs()
    assert time.monotonic() - served <= 10
    warning = next(line for line in log_lines(cluster, "lonely") if WARN in line)
    assert "WARNING" in warning and cluster.endpoint in warning
    cluster.start_tracker()  # it comes up: the node says so and registers
    cluster.wait_nodes(["lonely"], model.name)
    assert wait_for(lambda: any("answers now" in line for line in log_lines(cluster, "lonely")), 10, 0.1)


def test_a_node_without_keys_says_once_that_the_tracker_needs_them(process_cluster, tiny_models):
    cluster, model = process_cluster, tiny_models("llama")
    cluster.secure()
    keys, cluster.keys = cluster.keys, None  # this one node starts without --keys
    cluster.start_node("keyless", str(model), "0-5")
    cluster.keys = keys
    assert wait_for(lambda: any(NEEDS_KEYS in line for line in log_lines(cluster, "keyless")), 60, 0.1), \
        cluster.logs()
    time.sleep(2)  # a few heartbeats' time: the line is not repeated, nor drowned in others
    lines = log_lines(cluster, "keyless")
    assert sum(NEEDS_KEYS in line for line in lines) == 1
    assert sum(bool(re.search("not reading|dropped", line)) for line in lines) <= 1
