"""One request's event stream from the fabric: the single producer both response kinds consume.

``Generation.open`` calls ``client.generate(...)`` and waits for the first event, so errors
the fabric reports up front (unknown model, no route, busy, ...) become HTTP statuses.
Iterating yields the fabric's events, with fabric errors turned into ``ApiError``.
``aclose()`` closes the fabric's iterator (which cancels the request along the route if it
has not finished) and records usage; it is idempotent and every consumer calls it in
``finally``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fabric.wire.protocol import Event, TokenLogprobs

from . import accounting as acct
from .errors import api_error_from, from_fabric
from .schema import GenerationRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    """What a non-streamed response needs: the whole text, the usage, and the tokens' logprobs
    when the request asked for them."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprobs, ...] = ()
    tool_syntax: str = ""  # the start event's: how the reply writes tool calls ("": not parsed)


class Generation:
    def __init__(self, source: AsyncIterator[Event], model: str, accounting: acct.Accounting):
        self._source = source
        self._model = model
        self._accounting = accounting
        self._first: Event | None = None
        self._tokens = 0  # token events seen, for usage when no done event arrives
        self.done: Event | None = None  # the fabric's done event, once seen
        self._failed = False
        self._closed = False

    @classmethod
    async def open(cls, client: Any, request: GenerationRequest, *, request_id: str,
                   api_key: str | None, accounting: acct.Accounting) -> Generation:
        """Start generating; raises ``ApiError`` if the fabric refuses the request."""
        try:
            source = client.generate(request.model, request_id=request_id, api_key=api_key,
                                     **request.generate_kwargs())
        except Exception as exc:
            error = api_error_from(exc)
            if error is None:
                raise
            accounting.record(request.model, acct.FAILED)
            raise error from exc
        generation = cls(source, request.model, accounting)
        try:
            generation._first = await generation._next()
            if generation._first is None:
                generation._failed = True
                raise from_fabric(None, "the fabric ended the request before it started")
        except BaseException:  # refused, failed, or the HTTP client left while we waited
            await generation.aclose()
            raise
        logger.debug("request %s started on route %s", request_id, generation._first.route)
        return generation

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Event:
        """The fabric's events, from the first; raises ``ApiError`` if the fabric fails."""
        if self._first is not None:
            event, self._first = self._first, None
        else:
            event = await self._next()
        if event is None:
            if self.done is None:
                self._failed = True
                raise from_fabric(None, "the fabric ended the request without finishing it")
            raise StopAsyncIteration
        self._observe(event)
        return event

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._source.aclose()
        except Exception:  # closing must not mask what made us close
            logger.warning("closing the fabric stream for %s failed", self._model, exc_info=True)
        self._record()

    async def _next(self) -> Event | None:
        """The next event, None at the end; fabric failures raise ``ApiError``."""
        try:
            event = await anext(self._source)
        except StopAsyncIteration:
            return None
        except Exception as exc:
            error = api_error_from(exc)
            if error is None:
                raise
            self._failed = True
            raise error from exc
        if event.event == "error":
            self._failed = True
            raise from_fabric(event.error_code, event.text)
        return event

    def _observe(self, event: Event) -> None:
        if event.event == "token":
            self._tokens += 1
        elif event.event == "done":
            self.done = event

    def _record(self) -> None:
        if self.done is not None:
            outcome = acct.COMPLETED
            usage = (self.done.prompt_tokens, self.done.completion_tokens)
        else:
            outcome = acct.FAILED if self._failed else acct.CANCELLED
            usage = (0, self._tokens)
        self._accounting.record(self._model, outcome, prompt_tokens=usage[0], completion_tokens=usage[1])


async def collect(generation: Generation) -> Completed:
    """Consume a whole generation for a non-streamed response; always closes it."""
    parts: list[str] = []
    logprobs: list[TokenLogprobs] = []
    syntax = ""
    try:
        async for event in generation:
            if event.event == "token":
                parts.append(event.text)
                logprobs.extend(event.logprobs)
            elif event.event == "start":
                syntax = event.tool_syntax
    finally:
        await generation.aclose()
    done = generation.done
    return Completed("".join(parts), done.finish_reason or "stop", done.prompt_tokens, done.completion_tokens,
                     tuple(logprobs), syntax)
