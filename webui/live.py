"""The dashboard's live feed: one SUB socket on the tracker's PUB, fanned out to listeners.

The tracker publishes ``[topic, msgpack payload]`` on ``plans``, ``stats`` and ``events``.
``LiveFeed`` reads them in one task (started and stopped with the app), keeps the latest
plans and stats, folds events into the Call wall (``CallBoard``) and per-node throughput
(``ThroughputMeter``), and hands every update to each ``Listener`` (one per open
``/api/events`` stream) as ``(name, data)``:

==========  ===============================================================
plans       the tracker's plans payload (``plans``, ``gaps``, ``weights_differ``, ``version``)
stats       the tracker's stats payload (``stats``, ``nodes``, ``usage``)
event       one raw tracker event (for the event log)
call        a Call wall row that changed (see ``webui.board``)
throughput  a new throughput sample ``{"ts", "tps": {node: tok/s}}``
==========  ===============================================================

No PUB reachable is not an error: ZeroMQ keeps trying to connect, and the dashboard
polls ``/api/status`` until the feed speaks (``absorb_status`` folds those polls in).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any, Callable

import msgpack
import zmq
import zmq.asyncio

from fabric.net.security import SecurityError, dial_securely
from fabric.wire.liveness import TOPIC_EVENTS, TOPIC_PLANS, TOPIC_STATS

from .board import CallBoard, ThroughputMeter

logger = logging.getLogger(__name__)

TOPICS = (TOPIC_PLANS, TOPIC_STATS, TOPIC_EVENTS)
RECENT_EVENTS = 50  # raw tracker events kept for a new dashboard's event log
LIVE_WITHIN_S = 10.0  # the feed counts as live if it heard the tracker this recently (stats: every 2 s)
CLOSED = ("closed", None)  # what a listener's get() returns once the feed has stopped

Update = tuple[str, Any]


class Listener:
    """One subscriber's bounded queue; when full the oldest update is dropped."""

    def __init__(self, size: int):
        self._queue: asyncio.Queue[Update] = asyncio.Queue(size)
        self.dropped = 0  # updates lost because this listener fell behind
        self.closed = False

    def put(self, update: Update) -> None:
        if self.closed:
            return
        if self._queue.full():
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(update)

    def drain(self) -> None:
        """Drop what is queued (a fresh snapshot replaces it); the end marker stays."""
        while not self._queue.empty():
            self._queue.get_nowait()
        if self.closed:
            self._queue.put_nowait(CLOSED)

    def close(self) -> None:
        """No more updates; a pending or later ``get`` returns ``CLOSED``."""
        if not self.closed:
            self.put(CLOSED)
            self.closed = True

    async def get(self, timeout: float) -> Update | None:
        """The next update, ``CLOSED`` at the end, or None after ``timeout`` seconds of quiet."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return CLOSED if self.closed and self._queue.empty() else None


def decode(frames: list[bytes]) -> tuple[str, dict] | None:
    """``(topic, payload)`` for a well-formed publication, else None (logged)."""
    if len(frames) != 2 or frames[0] not in TOPICS:
        logger.debug("ignoring a %d-frame publication", len(frames))
        return None
    try:
        payload = msgpack.unpackb(frames[1], raw=False)
        json.dumps(payload)  # the dashboard gets it as JSON: refuse what would not encode
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        logger.warning("ignoring an undecodable %s publication: %s", frames[0].decode(), exc)
        return None
    if not isinstance(payload, dict):
        return None
    return frames[0].decode(), payload


class LiveFeed:
    """The tracker's PUB as dashboard updates. ``start``/``stop`` bracket the app's life."""

    def __init__(self, endpoint: str | None, *, queue_size: int = 512, idle_timeout: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, security=None,
                 on_plans: Callable[[dict], None] | None = None):
        self.endpoint = endpoint  # None: no feed; the dashboard polls /api/status
        self.on_plans = on_plans  # called with every plans publication (the client remembers routes)
        self.board = CallBoard(idle_timeout=idle_timeout)
        self.meter = ThroughputMeter()
        self.plans: dict | None = None  # latest ``plans`` publication
        self.stats: dict | None = None  # latest ``stats`` publication
        self.events: deque[dict] = deque(maxlen=RECENT_EVENTS)  # latest raw events, oldest first
        self.received = 0  # publications handled
        self.error: str | None = None  # why the feed could not start
        self._queue_size = queue_size
        self._clock = clock
        self._heard_at: float | None = None
        self._listeners: set[Listener] = set()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._security = security  # fabric.net.security.Security, or None for plaintext

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> None:
        """Connect and start reading; never raises for a bad or unreachable endpoint."""
        self._stopped = False
        if not self.endpoint or self._task is not None:
            return
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            dial_securely(sock, self._security, self._security and self._security.tracker_key)
            sock.connect(self.endpoint)
        except (zmq.ZMQError, SecurityError) as exc:
            sock.close(linger=0)
            self.error = f"cannot connect to {self.endpoint}: {exc}"
            logger.warning("live feed off: %s", self.error)
            return
        for topic in TOPICS:
            sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._socket = sock
        self._task = asyncio.create_task(self._read(sock), name="meshnet-live-feed")
        logger.info("live feed subscribed to %s", self.endpoint)

    async def stop(self) -> None:
        """Stop reading, close the socket and end every listener's stream."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        for listener in list(self._listeners):
            listener.close()
        self._listeners.clear()

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError as exc:
                logger.warning("live feed stopped reading: %s", exc)
                return
            decoded = decode(frames)
            if decoded is None:
                continue
            try:
                self.handle(*decoded)
            except Exception:  # one odd publication must not end the dashboard's feed
                logger.exception("live feed could not handle a %s publication", decoded[0])

    # ----------------------------------------------------------------- listeners

    def listen(self) -> Listener:
        """A new subscriber. Before ``start`` (or without a feed) it only gets keep-alives."""
        listener = Listener(self._queue_size)
        if self._stopped:
            listener.close()  # shutting down: the stream ends at once
        else:
            self._listeners.add(listener)
        return listener

    def unlisten(self, listener: Listener) -> None:
        self._listeners.discard(listener)
        listener.close()

    def _broadcast(self, updates: list[Update]) -> None:
        for listener in self._listeners:
            for update in updates:
                listener.put(update)

    # ----------------------------------------------------------------- state

    @property
    def live(self) -> bool:
        """True while the tracker's publications arrive."""
        return self._heard_at is not None and self._clock() - self._heard_at < LIVE_WITHIN_S

    def handle(self, topic: str, payload: dict) -> None:
        """Fold one publication in and pass what changed to every listener."""
        self.received += 1
        self._heard_at = self._clock()
        if topic == "plans":
            self.plans = payload
            if self.on_plans is not None:
                self.on_plans(payload)
            updates: list[Update] = [("plans", payload)]
        elif topic == "stats":
            self.stats = payload
            updates = [("stats", payload), *self._tick(_number(payload.get("ts")), payload.get("nodes"))]
        else:
            self.events.append(payload)
            updates = [("event", payload), *self._fold([payload])]
        self._broadcast(updates)

    def absorb_status(self, status: dict, now: float) -> None:
        """Fold a status poll's recent events in (what the feed already sent is ignored).

        While the feed is not live, the poll also drives the throughput samples and expiry.
        """
        events = [e for e in status.get("events", []) if isinstance(e, dict)]
        updates = self._fold(sorted(events, key=lambda e: _number(e.get("seq"))))
        if not self.live:
            updates += self._tick(now, status.get("nodes"))
        self._broadcast(updates)

    def snapshot(self) -> dict:
        """What a new dashboard needs before live updates: the ``hello`` of /api/events."""
        return {"feed": self.describe(), "plans": self.plans, "stats": self.stats,
                "events": list(self.events), "calls": self.board.snapshot(),
                "throughput": list(self.meter.history)}

    def describe(self) -> dict:
        return {"endpoint": self.endpoint, "live": self.live, "received": self.received,
                "error": self.error}

    def _fold(self, events: list[dict]) -> list[Update]:
        updates: list[Update] = []
        for event in events:
            self.meter.observe(event)
            row = self.board.apply(event, self._clock())
            if row is not None:
                updates.append(("call", row))
        return updates

    def _tick(self, ts: float, nodes: Any) -> list[Update]:
        names = [str(n.get("id")) for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []
        updates: list[Update] = [("call", row) for row in self.board.expire(self._clock())]
        point = self.meter.sample(ts, names)
        if point is not None:
            updates.append(("throughput", point))
        return updates


def _number(value: Any) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
