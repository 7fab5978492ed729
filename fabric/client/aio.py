"""The asyncio client, a thin shell over ``core`` with the same calls as ``Client``.

    async with AsyncClient("tcp://127.0.0.1:5555") as c:  # or close() it
        async for event in c.generate("smollm2-135m", prompt="Once upon a time", max_tokens=32):
            print(event.text, end="", flush=True)
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import zmq
import zmq.asyncio

from ..net.security import Security
from ..wire import protocol as p
from ..wire.liveness import DEFAULT_TRACKER
from .core import (
    ClientCore,
    Continuation,
    FabricError,
    GenerateArgs,
    HeadGone,
    HeadLink,
    decode_reply,
    models_of,
    route_from,
    stranded,
)


class AsyncClient(ClientCore):
    """asyncio client with the same calls as ``Client``."""

    def __init__(self, tracker: str = DEFAULT_TRACKER, *, timeout: float = 30.0,
                 security: Security | None = None):
        super().__init__(tracker, timeout, security, zmq.asyncio.Context.instance())
        self._lock = asyncio.Lock()  # one question at a time on the shared tracker socket

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._drop_tracker()

    async def ask(self, message: p.Message) -> p.Message:
        """One request/reply with the tracker."""
        async with self._lock:
            sock = self._tracker_socket()
            try:
                await sock.send_multipart(p.encode(message), zmq.NOBLOCK)
                if not await sock.poll(self._tracker_wait_ms):
                    raise self._silent()
                return self._answered(decode_reply(await sock.recv_multipart()))
            except zmq.Again:  # no link to the tracker can take it (a refused handshake, say)
                raise self._silent() from None
            except BaseException:
                self._drop_tracker()
                raise

    async def status(self) -> dict:
        return self._status(await self.ask(p.StatusRequest()))

    async def models(self) -> list[dict]:
        """As ``Client.models``."""
        try:
            return models_of(await self.status())
        except FabricError as exc:
            return self._remembered_models(exc)

    async def route(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...]:
        """As ``Client.route``: while the tracker is away, a remembered route."""
        try:
            return self._routed(model, route_from(await self.ask(p.RouteRequest(model, exclude))))
        except FabricError as exc:
            return self._remembered(model, exclude, exc)

    def generate(self, model: str, *, route: tuple[p.Hop, ...] | None = None, **kwargs) -> AsyncIterator[p.Event]:
        """As ``Client.generate`` (the same keyword arguments), for ``async for``. Wrong
        arguments raise here, at the call; the route is asked for at the first event."""
        return self._stream(GenerateArgs.of(model, **kwargs), route)

    async def _stream(self, args: GenerateArgs, route) -> AsyncIterator[p.Event]:
        """Stream a request; when its head dies, it goes on at another (``Continuation``)."""
        stream = Continuation(args.message(route or await self.route(args.model)), route is not None)
        while True:
            try:
                async with contextlib.aclosing(self._attempt(stream.msg)) as events:
                    async for event in events:
                        if stream.passes(event):
                            yield event
                return
            except HeadGone as died:
                stream.go_on(died, await self._route_around(args.model, died, stream))

    async def _route_around(self, model: str, died: HeadGone, stream: Continuation) -> tuple[p.Hop, ...]:
        for exclude in self._around(died, stream):
            try:
                return await self.route(model, exclude)
            except FabricError as exc:
                why = exc
        raise stranded(died, why) from None

    async def _attempt(self, msg: p.Generate) -> AsyncIterator[p.Event]:
        poller = zmq.asyncio.Poller()
        head = HeadLink(self.ctx, msg, self.security, poller)
        try:
            await head.sock.send_multipart(head.request)
            while not head.done:
                head.check(dict(await poller.poll(self.timeout * 1000)))
                yield head.take(await head.sock.recv_multipart())
        finally:
            if not head.done:
                await head.sock.send_multipart(head.cancel)
            head.close()
