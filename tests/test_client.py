"""The scripting client's own behaviour against a scripted tracker on loopback."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from fabric import AsyncClient, Client, FabricError
from fabric.wire import protocol as p


class SlowTracker:
    """A ROUTER that answers STATUS and ROUTE_REQUEST after ``delay`` seconds."""

    def __init__(self, delay: float):
        self.delay = delay
        self.stop = threading.Event()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg, _ = p.decode(frames)
            time.sleep(self.delay)
            reply = (p.Status({"nodes": [], "plans": {}}) if isinstance(msg, p.StatusRequest)
                     else p.Route(msg.model, (p.Hop("n", "tcp://127.0.0.1:1", 0, 1),)))
            self.sock.send_multipart([identity, *p.encode(reply)])
        self.sock.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def slow_tracker():
    tracker = SlowTracker(0.3)
    yield tracker
    tracker.close()


@pytest.mark.asyncio
async def test_cancelled_question_never_answers_the_next_one(slow_tracker):
    client = AsyncClient(slow_tracker.endpoint, timeout=5)
    try:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.status(), 0.05)
        route = await client.route("m")  # must not receive the late STATUS reply
        assert route[0].node == "n"
    finally:
        await client.close()


def test_sync_client_times_out_then_recovers(slow_tracker):
    with Client(slow_tracker.endpoint, timeout=0.1) as client:
        with pytest.raises(FabricError, match="did not answer"):
            client.status()
        client.timeout = 5
        assert client.route("m")[0].node == "n"


def test_bad_arguments_are_refused_before_any_socket():
    with Client("tcp://127.0.0.1:1") as client:
        hop = (p.Hop("n", "tcp://127.0.0.1:1", 0, 1),)
        with pytest.raises(FabricError, match="exactly one of messages or prompt"):
            client.generate("m", route=hop)
        with pytest.raises(FabricError, match="max_tokens"):
            client.generate("m", prompt="x", max_tokens=0, route=hop)
