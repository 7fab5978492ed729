"""The scripting client's own behaviour against a scripted tracker on loopback."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from fabric import AsyncClient, Client, FabricError
from fabric.wire import protocol as p
from tests.support import wait_for


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


def test_a_question_that_times_out_never_answers_the_next_one(slow_tracker, shell):
    with shell(slow_tracker.endpoint, timeout=0.1) as client:
        with pytest.raises(FabricError, match="did not answer"):
            client.status()
        client.timeout = 5
        assert client.route("m")[0].node == "n"  # not the late STATUS reply


class CountingTracker:
    """A ROUTER that holds its answer to a first question until ``second_asked`` is set, then
    gives a second question ``window`` seconds to arrive before it answers: ``overlapped`` says
    whether a second question reached it while the first was open. (A slow machine can only
    make an overlap go unseen, never make one up.)"""

    def __init__(self, window: float = 1.0):
        self.window = window
        self.first_seen = threading.Event()
        self.second_asked = threading.Event()
        self.overlapped = False
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        for n in range(2):
            if not self.sock.poll(30_000):
                return
            identity, *frames = self.sock.recv_multipart()
            if n == 0:
                self.first_seen.set()
                self.second_asked.wait(30)
                self.overlapped = bool(self.sock.poll(self.window * 1000))
            msg, _ = p.decode(frames)
            self.sock.send_multipart([identity, *p.encode(p.Route(msg.model, (p.Hop("n", "tcp://127.0.0.1:1", 0, 1),)))])

    def close(self) -> None:
        self.thread.join(5)
        self.sock.close()


def test_the_blocking_client_asks_one_question_at_a_time():
    """Two threads share one client: the second question waits for the first one's answer (the
    tracker socket is one DEALER, and a reply must reach the question it answers)."""
    tracker = CountingTracker()
    answers: dict[str, tuple] = {}
    with Client(tracker.endpoint, timeout=30) as client:
        def ask(model: str) -> None:
            answers[model] = client.route(model)

        first = threading.Thread(target=ask, args=("m1",))
        first.start()
        assert tracker.first_seen.wait(10)
        second = threading.Thread(target=ask, args=("m2",))
        second.start()
        tracker.second_asked.set()
        first.join(30), second.join(30)
    tracker.close()
    assert set(answers) == {"m1", "m2"} and not tracker.overlapped


def test_the_asyncio_client_asks_one_question_at_a_time():
    tracker = CountingTracker()

    async def both() -> list:
        async with AsyncClient(tracker.endpoint, timeout=30) as client:
            first = asyncio.ensure_future(client.route("m1"))
            while not tracker.first_seen.is_set():
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(client.route("m2"))
            await asyncio.sleep(0)  # the second task reaches the lock
            tracker.second_asked.set()
            return await asyncio.gather(first, second)

    answers = asyncio.run(both())
    tracker.close()
    assert [r[0].node for r in answers] == ["n", "n"] and not tracker.overlapped


def test_bad_arguments_are_refused_before_any_socket(shell):
    with shell("tcp://127.0.0.1:1") as client:
        hop = (p.Hop("n", "tcp://127.0.0.1:1", 0, 1),)
        with pytest.raises(FabricError, match="exactly one of messages or prompt"):
            client.generate("m", route=hop)
        with pytest.raises(FabricError, match="max_tokens"):
            client.generate("m", prompt="x", max_tokens=0, route=hop)


class ScriptedSwarm:
    """A tracker and two heads on loopback: head a takes a GENERATE and then says nothing;
    head b streams ``tokens`` and a done. The tracker routes to a unless a is excluded."""

    def __init__(self, tokens: tuple[int, ...]):
        self.tokens = tokens
        self.stop = threading.Event()
        self.seen: dict[str, list] = {"tracker": [], "a": [], "b": []}
        ctx = zmq.Context.instance()
        self.socks = {}
        for name in self.seen:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            self.socks[name] = (sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
        self.endpoint = self.socks["tracker"][1]
        self.hops = {n: p.Hop(n, self.socks[n][1], 0, 1) for n in ("a", "b")}
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        poller = zmq.Poller()
        for sock, _ in self.socks.values():
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            for name, (sock, _) in self.socks.items():
                if not dict(poller.poll(20)).get(sock):
                    continue
                identity, *frames = sock.recv_multipart()
                msg, _ = p.decode(frames)
                self.seen[name].append(msg)
                for reply in self.answer(name, msg):
                    sock.send_multipart([identity, *p.encode(reply)])
        for sock, _ in self.socks.values():
            sock.close()

    def answer(self, name: str, msg) -> list:
        if name == "tracker":
            return [p.Route(msg.model, (self.hops["b" if "a" in msg.exclude else "a"],))]
        if name == "a" or not isinstance(msg, p.Generate):
            return []  # a hangs
        rid = msg.request_id
        return [p.Event(rid, "start", route=msg.route, seed=9),
                *(p.Event(rid, "token", text=str(t), token_ids=(t,)) for t in self.tokens),
                p.Event(rid, "done", finish_reason="length", completion_tokens=len(self.tokens))]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def test_the_route_is_asked_for_at_the_first_event(shell):
    """Both shells: ``generate`` checks the arguments and returns; the tracker hears of the
    request when the caller takes the first event (an async generator can do nothing sooner)."""
    swarm = ScriptedSwarm((4,))
    try:
        with shell(swarm.endpoint, timeout=0.5) as client:
            events = client.generate("m", prompt="x", max_tokens=1)
            assert swarm.seen["tracker"] == [] and client.routes.instead("m") is None  # nor learnt
            assert next(events).event == "start"  # from b, after a said nothing
            assert swarm.seen["tracker"][0] == p.RouteRequest("m", ())
            assert [e.event for e in events] == ["token", "done"]
    finally:
        swarm.close()


def test_a_silent_head_hands_the_request_to_another(shell):
    swarm = ScriptedSwarm((4, 5, 6))
    try:
        with shell(swarm.endpoint, timeout=0.5) as client:
            events = list(client.generate("m", prompt="x", max_tokens=3))
        assert [t for e in events for t in e.token_ids] == [4, 5, 6] and events[-1].event == "done"
        assert wait_for(lambda: len(swarm.seen["a"]) == 2, 5)
        generate, cancel = swarm.seen["a"]  # the silent head was told to drop the request
        assert isinstance(cancel, p.Cancel) and cancel.session == generate.request_id
        (moved,) = swarm.seen["b"]
        assert moved.request_id == generate.request_id and moved.resume == ()
        assert swarm.seen["tracker"][-1].exclude == ("a",)
    finally:
        swarm.close()


def test_a_silent_head_on_a_route_the_caller_chose_is_an_error(shell):
    swarm = ScriptedSwarm(())
    try:
        with shell(swarm.endpoint, timeout=0.3) as client, pytest.raises(FabricError, match="head a .* silent"):
            list(client.generate("m", prompt="x", max_tokens=3, route=(swarm.hops["a"],)))
    finally:
        swarm.close()
