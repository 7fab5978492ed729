"""Can the tracker reach a node at the endpoint it registered? One PING to find out.

A node behind NAT that advertises its private address registers fine (it dialled the
tracker) but no peer can connect to it. The tracker checks each newly registered
endpoint once: it dials it, sends a PING and waits ``timeout`` seconds for the PONG. The
checks run in one worker thread (a ZeroMQ context is thread-safe for making sockets; each
socket lives in that thread only), so the service loop never waits on them; it collects
the results with ``results()``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from fabric.net.security import Security, SecurityError, dial
from fabric.wire import protocol as p

log = logging.getLogger(__name__)

MAX_PENDING_CHECKS = 1024  # checks queued or running; more are dropped (the node stays "not checked yet")


@dataclass(frozen=True)
class Check:
    node_id: str
    endpoint: str
    key: str  # the key to dial it with (secured swarms)


@dataclass(frozen=True)
class Result:
    node_id: str
    endpoint: str
    reachable: bool


class ReachChecker:
    def __init__(self, ctx: zmq.Context, security: Security | None, timeout: float = 3.0):
        self.ctx, self.security, self.timeout = ctx, security, timeout
        self._jobs: queue.Queue[Check | None] = queue.Queue()
        self._pending: set[Check] = set()  # queued or running: the same check is not queued twice
        self._lock = threading.Lock()  # guards _pending (the service loop adds, the worker removes)
        self._results: deque[Result] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="reach-checker", daemon=True)
        self._thread.start()

    def check(self, node_id: str, endpoint: str, key: str = "") -> bool:
        """Queue a check; False when the same one is already pending, or ``MAX_PENDING_CHECKS``
        are (a member re-registering in a loop must not queue sockets without end)."""
        job = Check(node_id, endpoint, key)
        with self._lock:
            if job in self._pending or len(self._pending) >= MAX_PENDING_CHECKS:
                return False
            self._pending.add(job)
        self._jobs.put(job)
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def results(self) -> list[Result]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    def close(self) -> None:
        self._stopping.set()  # checks in progress give up at once
        self._jobs.put(None)
        self._thread.join(5)

    def _work(self) -> None:
        while True:
            batch = [self._jobs.get()]
            while not self._jobs.empty():  # check everything queued at once
                batch.append(self._jobs.get())
            if None in batch:
                return
            for check, ok in self._ping_all(batch):
                self._results.append(Result(check.node_id, check.endpoint, ok))
                with self._lock:
                    self._pending.discard(check)

    def _ping_all(self, checks: list[Check]) -> list[tuple[Check, bool]]:
        socks: dict[zmq.Socket, Check] = {}
        answered: set[zmq.Socket] = set()
        undialled: list[Check] = []  # a bad endpoint or key: unreachable without a try
        try:
            for check in checks:
                try:
                    sock = dial(self.ctx, check.endpoint, self.security, check.key, sndhwm=None)
                except (zmq.ZMQError, SecurityError) as exc:
                    log.info("cannot dial %s at %s: %s", check.node_id, check.endpoint, exc)
                    undialled.append(check)
                    continue
                socks[sock] = check
                sock.send_multipart(p.encode(p.Ping(1)), zmq.NOBLOCK)
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            deadline = time.monotonic() + self.timeout
            while (len(answered) < len(socks) and not self._stopping.is_set()
                   and (left := deadline - time.monotonic()) > 0):
                for sock, _ in poller.poll(min(left, 0.1) * 1000):
                    sock.recv_multipart()  # any answer (a PONG, even an ERROR) means it is reachable
                    answered.add(sock)
                    poller.unregister(sock)
        finally:
            for sock in socks:
                sock.close(linger=0)
        return [(check, sock in answered) for sock, check in socks.items()] + [(check, False) for check in undialled]
