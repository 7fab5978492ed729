"""The asyncio client, a thin shell over ``core`` with the same calls as ``Client``.

    async with AsyncClient("tcp://127.0.0.1:5555") as c:  # or close() it
        async for event in c.generate("smollm2-135m", prompt="Once upon a time", max_tokens=32):
            print(event.text, end="", flush=True)
"""
from __future__ import annotations

import asyncio
import inspect
from typing import AsyncIterator

import zmq
import zmq.asyncio

from ..net.security import Security
from ..wire import protocol as p
from ..wire.liveness import DEFAULT_TRACKER
from .core import ClientCore, GenerateArgs, Program, T
from .stream import RequestStream


class AsyncClient(ClientCore):
    """asyncio client with the same calls as ``Client``. Every decision is ``ClientCore``'s;
    this shell only does the I/O (``_run``)."""

    def __init__(self, tracker: str = DEFAULT_TRACKER, *, timeout: float = 30.0,
                 security: Security | None = None):
        super().__init__(tracker, timeout, security, zmq.asyncio.Context.instance(), poller=zmq.asyncio.Poller,
                         lock=asyncio.Lock())

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._drop_tracker()

    async def ask(self, message: p.Message) -> p.Message:
        """One request/reply with the tracker."""
        return await self._run(self._ask_program(message))

    async def status(self) -> dict:
        return await self._run(self._status_program())

    async def models(self) -> list[dict]:
        """As ``Client.models``."""
        return await self._run(self._models_program())

    async def route(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...]:
        """As ``Client.route``: while the tracker is away, a remembered route."""
        return await self._run(self._route_program(model, exclude))

    def generate(self, model: str, *, route: tuple[p.Hop, ...] | None = None, **kwargs) -> AsyncIterator[p.Event]:
        """As ``Client.generate`` (the same keyword arguments), for ``async for``. Wrong
        arguments raise here, at the call; the route is asked for at the first event."""
        return self._events(RequestStream(self, GenerateArgs.of(model, **kwargs), route))

    async def _events(self, stream: RequestStream) -> AsyncIterator[p.Event]:
        try:
            while (event := await self._run(stream.next_event())) is not None:
                yield event
        finally:  # a break, an error, a cancelled task: the request is cancelled along the route
            await self._run(stream.end())

    @staticmethod
    async def _run(program: Program[T]) -> T:
        """As ``Client._run``, awaiting what a Call returns when it is awaitable."""
        result, error = None, None
        while True:
            try:
                call = program.send(result) if error is None else program.throw(error)
            except StopIteration as done:
                return done.value
            try:
                result, error = getattr(call.target, call.method)(*call.args), None
                if inspect.isawaitable(result):
                    result = await result
            except BaseException as exc:  # the program decides what an error means, a cancel's too
                result, error = None, exc
