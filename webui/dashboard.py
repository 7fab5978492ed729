"""The dashboard's own endpoints, under /api (the page itself is ``static/index.html``).

``GET /api/status``  the tracker's status body (nodes, plans, gaps, weights_differ, events, stats, usage)
                     plus the Call wall, throughput history and this web UI's feed state:
                     the page's first load and its fallback while the live feed is quiet.
``GET /api/events``  server-sent events: ``hello`` (a full snapshot: feed state, latest
                     plans and stats, recent events, Call wall, throughput history; sent
                     again whenever this stream fell behind and lost updates), then ``plans``, ``stats``,
                     ``event``, ``call`` and ``throughput`` as ``webui.live`` describes, and
                     ``accounting`` (this web UI's request totals) after each ``stats``.

With API keys configured both need ``Authorization: Bearer <key>``, like /v1.
"""
from __future__ import annotations

import time
from typing import AsyncIterator

from quart import Blueprint, Response, current_app, jsonify

from . import sse
from .accounting import Accounting
from .errors import SERVER_ERROR, ApiError, api_error_from
from .live import CLOSED, Listener, LiveFeed
from .openai_api import api_context, check_api_key

LIVE_EXTENSION = "meshnet.live"  # key of the LiveFeed in app.extensions

blueprint = Blueprint("dashboard_api", __name__, url_prefix="/api")
blueprint.before_request(check_api_key)


def live_feed() -> LiveFeed:
    return current_app.extensions[LIVE_EXTENSION]


@blueprint.get("/status")
async def status() -> Response:
    ctx, feed = api_context(), live_feed()
    body = await _tracker_status()
    feed.absorb_status(body, time.time())
    return jsonify({**body, "calls": feed.board.snapshot(), "throughput": list(feed.meter.history),
                    "webui": {"feed": feed.describe(), "accounting": ctx.accounting.snapshot(),
                              "auth": bool(ctx.config.api_keys)}})


@blueprint.get("/events")
async def events() -> Response:
    feed = live_feed()
    listener = feed.listen()

    async def release() -> None:
        feed.unlisten(listener)

    ctx = api_context()
    return sse.response(stream(feed, listener, ctx.config.sse_keepalive, ctx.accounting), release)


async def stream(feed: LiveFeed, listener: Listener, keepalive: float,
                 accounting: Accounting | None = None) -> AsyncIterator[bytes]:
    """The /api/events body: a snapshot, then updates, with keep-alives while quiet.

    Each ``stats`` update is followed by ``accounting``: this web UI's own request totals.
    """
    yield sse.event(feed.snapshot(), name="hello")
    dropped = 0
    while True:
        update = await listener.get(keepalive)
        if update is None:
            yield sse.comment("keep-alive")
            continue
        if update is CLOSED:
            return
        if listener.dropped != dropped:  # this stream fell behind: resynchronise the page
            dropped = listener.dropped
            listener.drain()
            yield sse.event(feed.snapshot(), name="hello")
            continue
        yield sse.event(update[1], name=update[0])
        if update[0] == "stats" and accounting is not None:
            yield sse.event(accounting.snapshot(), name="accounting")


async def _tracker_status() -> dict:
    try:
        return await api_context().client.status()
    except Exception as exc:
        error = api_error_from(exc)
        if error is None:
            raise
        raise ApiError(503, f"the tracker did not answer: {error.message}", SERVER_ERROR, None,
                       "tracker_unavailable") from exc
