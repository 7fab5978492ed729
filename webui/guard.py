"""The last line under the app: no HTTP response is ever an empty 500.

Quart renders every ``Exception`` a handler raises through the app's error handlers (JSON
error objects under /v1 and /api). Two ways round them remain, and the server answers both
with a 500 and no body: a handler that ends in ``asyncio.CancelledError`` although nobody
cancelled it (a ZeroMQ socket of the fabric client closed under an await raises it), and
an app that returns without starting a response. ``JsonErrors`` wraps the ASGI app and
answers either with an OpenAI error object that says what went wrong. A request the HTTP
client left, or the server's own shutdown, is still cancelled as it should be.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from .errors import SERVER_ERROR, ApiError

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Send = Callable[[dict], Awaitable[None]]


def cut_short(what: str) -> ApiError:
    return ApiError(500, f"the web UI could not finish this request: {what}", SERVER_ERROR, None, "internal")


class JsonErrors:
    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if started or (task is not None and task.cancelling()):
                raise  # really cancelled: the HTTP client left, or the server stops
            await _answer(scope, send, cut_short("an operation of the fabric client was cancelled under it"))
            return
        except Exception as exc:
            if started:
                raise
            await _answer(scope, send, cut_short(f"{type(exc).__name__}: {exc}"))
            return
        if not started:
            await _answer(scope, send, cut_short("the request ended without a response (was it cancelled?)"))


async def _answer(scope: Scope, send: Send, error: ApiError) -> None:
    logger.error("%s %s: %s", scope.get("method"), scope.get("path"), error)
    body = json.dumps(error.body()).encode()
    try:
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    except Exception:  # the connection is gone: nobody to tell
        logger.debug("could not send the error response", exc_info=True)
