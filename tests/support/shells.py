"""Either client shell behind the blocking client's calls, so that one client test runs
against both (the ``shell`` fixture in tests/conftest.py).

``Client`` is used as it is. ``AsyncClient`` is driven on an event loop of its own: each call
runs to its end there, and a generation's events are taken one ``__anext__`` at a time, so the
test sees them as it would see the blocking client's (and a ``close`` of the stream is the
async generator's ``aclose``, as a break in ``async for`` is)."""
from __future__ import annotations

import asyncio
from typing import Iterator

from fabric import AsyncClient, Client


class BlockingAsync:
    """An ``AsyncClient`` with ``Client``'s blocking calls."""

    def __init__(self, tracker: str, **kwargs):
        self.__dict__["client"] = AsyncClient(tracker, **kwargs)
        self.__dict__["loop"] = asyncio.new_event_loop()

    def __getattr__(self, name: str):  # routes, timeout, tracker_endpoint, learn_plans: the client's own
        return getattr(self.client, name)

    def __setattr__(self, name: str, value) -> None:  # client.timeout = 5 sets the client's
        setattr(self.client, name, value)

    def __enter__(self) -> "BlockingAsync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait(self, awaitable):
        return self.loop.run_until_complete(awaitable)

    def close(self) -> None:
        self._wait(self.client.close())
        self.loop.close()

    def ask(self, message):
        return self._wait(self.client.ask(message))

    def status(self) -> dict:
        return self._wait(self.client.status())

    def models(self) -> list[dict]:
        return self._wait(self.client.models())

    def route(self, model: str, exclude: tuple[str, ...] = ()):
        return self._wait(self.client.route(model, exclude))

    def generate(self, model: str, **kwargs) -> Iterator:
        """As ``Client.generate``: wrong arguments raise at the call (``AsyncClient.generate``
        checks them there too), the events come one by one."""
        return self._events(self.client.generate(model, **kwargs))

    def _events(self, events) -> Iterator:
        try:
            while True:
                try:
                    yield self._wait(events.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._wait(events.aclose())

    def chat(self, model: str, prompt: str, **kwargs) -> str:
        events = self.generate(model, messages=[{"role": "user", "content": prompt}], **kwargs)
        return "".join(e.text for e in events if e.event == "token")


SHELLS = {"sync": Client, "async": BlockingAsync}
