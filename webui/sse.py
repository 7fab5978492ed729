"""Server-sent events: framing, and a response body that always releases its source."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable

from quart import Response

DONE = b"data: [DONE]\n\n"  # OpenAI's end-of-stream sentinel

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
}


def encode_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(data: Any, *, name: str | None = None, event_id: str | None = None) -> bytes:
    """One SSE event. ``data`` that is not a str is sent as compact JSON.

    Multi-line data becomes one ``data:`` line per line, as the SSE spec requires.
    """
    text = data if isinstance(data, str) else encode_json(data)
    lines = []
    if name is not None:
        lines.append(f"event: {_single_line(name)}")
    if event_id is not None:
        lines.append(f"id: {_single_line(event_id)}")
    lines.extend(f"data: {line}" for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    return ("\n".join(lines) + "\n\n").encode("utf-8", errors="replace")


def comment(text: str = "") -> bytes:
    """An SSE comment line (ignored by clients; useful as a keep-alive)."""
    return f": {_single_line(text)}\n\n".encode("utf-8", errors="replace")


def _single_line(text: str) -> str:
    if "\n" in text or "\r" in text:
        raise ValueError("SSE field values other than data must be one line")
    return text


class ClosingStream:
    """An async iterator over ``body`` whose ``aclose`` also runs ``on_close``.

    Quart closes a response body when the HTTP client disconnects, but closing an async
    generator that never started runs none of its ``finally`` blocks; ``on_close`` runs
    regardless, so the resource behind the stream is released on every path.
    """

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        self._body = body
        self._on_close = on_close

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._body)

    async def aclose(self) -> None:
        try:
            if hasattr(self._body, "aclose"):
                await self._body.aclose()
        finally:
            await self._on_close()


def response(body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], *,
             headers: dict[str, str] | None = None) -> Response:
    """A ``text/event-stream`` response streaming ``body``, with no response timeout."""
    resp = Response(ClosingStream(body, on_close), mimetype="text/event-stream",
                    headers={**SSE_HEADERS, **(headers or {})})
    resp.timeout = None  # a generation may stream for longer than Quart's default 60 s
    return resp
