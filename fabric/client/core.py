"""The scripting API over ZeroMQ: ask the tracker for a route, stream tokens from the head.

    from fabric import Client
    with Client("tcp://127.0.0.1:5555") as c:
        for event in c.generate("smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                temperature=0.7, top_k=40, seed=1, stop=["\n\n"]):
            print(event.text, end="", flush=True)

``AsyncClient`` offers the same over asyncio. Closing a generation early (break, or
``aclose()``) cancels the request along the route, and every hop frees its KV.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Sequence

import msgpack
import zmq
import zmq.asyncio

from ..net.security import Security, SecurityError, dial_securely
from ..wire import protocol as p


class FabricError(Exception):
    """The fabric refused or failed a request. ``code`` is a ``protocol.ErrorCode`` value."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


TRACKER_TIMEOUT = 5.0  # a running tracker answers at once: waiting longer only delays the error


def _tracker_silent(endpoint: str) -> FabricError:
    return FabricError(p.ErrorCode.TRACKER_UNAVAILABLE,
                       f"tracker at {endpoint} did not answer (is it running? a secured swarm needs --keys)")


class HeadDied(FabricError):
    """The connection to the head dropped: its process is gone."""

    def __init__(self, head: p.Hop):
        super().__init__(p.ErrorCode.HOP_FAILED, f"the head {head.node} at {head.endpoint} died")
        self.head = head


# the link to the head dropped, or it refuses connections: its process is gone
HEAD_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(p.Sampling))  # temperature, top_k, top_p, seed
# a stand-in route: a call's arguments are checked before the tracker names the real one
_ANY_ROUTE = (p.Hop("any", "tcp://127.0.0.1:1", 0, 0),)


@dataclass(frozen=True)
class GenerateArgs:
    """One ``generate`` call's arguments, checked by ``of`` as the head will check them."""

    model: str
    messages: tuple[dict, ...] | None
    prompt: str | None
    max_tokens: int
    stop: tuple[str, ...]
    sampling: p.Sampling
    request_id: str
    api_key: str | None
    ignore_eos: bool = False

    @classmethod
    def of(cls, model: str, *, messages=None, prompt=None, max_tokens=256, stop=(), ignore_eos=False,
           sampling: p.Sampling | None = None, request_id=None, api_key=None, **fields) -> GenerateArgs:
        """The arguments of ``generate``; ``fields`` (temperature, top_k, top_p, seed) override
        ``sampling``'s, None keeping it. A wrong type or value is a FabricError (bad_request)
        naming the field, with the limits of ``protocol``, before any socket is used."""
        if unknown := set(fields) - set(SAMPLING_FIELDS):
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(unknown)}")
        chosen = {name: value for name, value in fields.items() if value is not None}
        args = cls(model, _messages(messages), prompt, max_tokens, _stops(stop),
                   dataclasses.replace(sampling or p.Sampling(), **chosen), request_id or uuid.uuid4().hex,
                   api_key, ignore_eos)
        args.message(_ANY_ROUTE)
        return args

    def message(self, route: tuple[p.Hop, ...]) -> p.Generate:
        """The GENERATE for ``route``, as the head will read it."""
        return _as_the_head_reads(p.Generate(
            request_id=self.request_id, route=tuple(route), messages=self.messages, prompt=self.prompt,
            max_tokens=self.max_tokens, stop=self.stop, sampling=self.sampling, api_key=self.api_key,
            ignore_eos=self.ignore_eos))


def _bad(message: str) -> FabricError:
    return FabricError(p.ErrorCode.BAD_REQUEST, message)


def _messages(messages) -> tuple[dict, ...] | None:
    if messages is None:
        return None
    try:
        if isinstance(messages, (str, bytes)):
            raise TypeError
        return tuple(dict(m) for m in messages)
    except (TypeError, ValueError):
        raise _bad("messages must be a list of {'role': ..., 'content': ...} maps") from None


def _stops(stop) -> tuple[str, ...]:
    """``stop`` as a tuple: one string, or a list of them (as OpenAI's ``stop``); None is none."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    try:
        return tuple(stop)
    except TypeError:
        raise _bad(f"stop must be a string or a list of strings, not {stop!r:.80}") from None


def _as_the_head_reads(msg: p.Generate) -> p.Generate:
    """``msg`` through the wire's own encode and decode: every field's type and range is checked
    where the head checks it (``protocol``, one set of limits), a wrong one named."""
    try:
        frames = p.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:  # msgpack cannot pack a value at all
        raise _unsendable(msg, exc) from None
    try:
        return p.decode(frames)[0]
    except p.ProtocolError as exc:  # "Sampling.top_k must be an int": the caller's word is top_k
        raise _bad(str(exc).removeprefix("Sampling.").removeprefix("Generate.")) from None


def _unsendable(msg: p.Generate, exc: Exception) -> FabricError:
    """Name the field msgpack cannot pack (an object, an int beyond 64 bits)."""
    try:
        msg.sampling.validate()  # an int too large for the wire is out of its range first
        msg.validate()
    except p.ProtocolError as out_of_range:
        return _bad(str(out_of_range))
    except TypeError:  # an object where a number belongs: named below
        pass
    for obj in (msg, msg.sampling):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in ("route", "sampling", "tensors"):
                continue
            try:
                msgpack.packb(value)
            except (TypeError, ValueError, OverflowError):
                return _bad(f"{f.name} cannot be sent: {value!r:.80}")
    return _bad(f"the request cannot be sent: {exc}")


def _route_from(reply: p.Message) -> tuple[p.Hop, ...]:
    if isinstance(reply, p.Route):
        return reply.hops
    if isinstance(reply, p.Error):
        raise FabricError(reply.code, reply.message)
    raise FabricError(p.ErrorCode.INTERNAL, f"tracker answered {type(reply).__name__}")


def _decode(frames) -> p.Message:
    """Decode a reply; a peer speaking another protocol is a FabricError too."""
    try:
        return p.decode(frames)[0]
    except p.ProtocolError as exc:
        raise FabricError(exc.code, f"bad reply: {exc}") from None


def _check(frames) -> p.Event:
    """An event from the head, or the FabricError it stands for."""
    event = _decode(frames)
    if isinstance(event, p.Error):
        raise FabricError(event.code, event.message)
    if not isinstance(event, p.Event):
        raise FabricError(p.ErrorCode.INTERNAL, f"head sent {type(event).__name__}")
    if event.event == "error":
        raise FabricError(event.error_code or p.ErrorCode.INTERNAL, event.text)
    return event


def _models(status: dict) -> list[dict]:
    by_model: dict[str, dict] = {}
    for node in status.get("nodes", []):
        entry = by_model.setdefault(node["model"], {"id": node["model"], "num_layers": node.get("num_layers"),
                                                    "nodes": 0, "routable": False})
        entry["nodes"] += 1
    for model, plans in status.get("plans", {}).items():
        if model in by_model and plans:
            by_model[model]["routable"] = True
    return sorted(by_model.values(), key=lambda m: m["id"])


def _dealer(ctx, endpoint: str, security: Security | None = None, server_key: str | bytes | None = None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        dial_securely(sock, security, server_key)
        sock.connect(endpoint)
    except (zmq.ZMQError, SecurityError) as exc:
        sock.close(linger=0)
        raise FabricError(p.ErrorCode.BAD_REQUEST, f"cannot dial {endpoint!r}: {exc}") from None
    return sock


class _ClientBase:
    """What both clients hold: where the tracker is, how long to wait, which keys to use."""

    def __init__(self, tracker: str, timeout: float, security: Security | None, ctx):
        self.tracker_endpoint = tracker
        self.timeout = timeout  # seconds to wait for the head's next event, or the tracker (TRACKER_TIMEOUT at most)
        self.security = security  # CurveZMQ keys for a secured swarm; None: plaintext
        self.ctx = ctx
        self._tracker = None  # DEALER to the tracker, made on first use

    @property
    def _tracker_wait_ms(self) -> float:
        return min(self.timeout, TRACKER_TIMEOUT) * 1000


class Client(_ClientBase):
    """Blocking client. ``generate(route=...)`` skips the tracker and uses that route."""

    def __init__(self, tracker: str = "tcp://127.0.0.1:5555", *, timeout: float = 30.0,
                 security: Security | None = None):
        super().__init__(tracker, timeout, security, zmq.Context.instance())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.close(linger=0)
            self._tracker = None

    def ask(self, message: p.Message) -> p.Message:
        """One request/reply with the tracker."""
        if self._tracker is None:
            self._tracker = _dealer(self.ctx, self.tracker_endpoint, self.security,
                                        self.security and self.security.tracker_key)
        self._tracker.send_multipart(p.encode(message))
        if not self._tracker.poll(self._tracker_wait_ms):
            self.close()  # drop the socket: a late reply must not answer the next question
            raise _tracker_silent(self.tracker_endpoint)
        return _decode(self._tracker.recv_multipart())

    def status(self) -> dict:
        reply = self.ask(p.StatusRequest())
        if not isinstance(reply, p.Status):
            raise FabricError(getattr(reply, "code", p.ErrorCode.INTERNAL), str(reply))
        return reply.body

    def models(self) -> list[dict]:
        return _models(self.status())

    def route(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...]:
        return _route_from(self.ask(p.RouteRequest(model, exclude)))

    def generate(self, model: str, *, messages=None, prompt=None, max_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = (), ignore_eos: bool = False,
                 sampling: p.Sampling | None = None, request_id: str | None = None,
                 api_key: str | None = None, route: tuple[p.Hop, ...] | None = None) -> Iterator[p.Event]:
        """Stream the events of one request: a chat (``messages``, OpenAI's role/content maps)
        or a raw ``prompt``. The sampling fields are OpenAI's (``top_k`` and ``ignore_eos`` as
        vLLM's): temperature 0 (the default) is greedy, ``top_k`` 0 and ``top_p`` 1 cut nothing,
        and a ``seed`` makes sampling repeatable. ``stop`` is a string or a list of them; the
        reply ends before the first one. ``sampling`` (a ``Sampling``) sets all four fields at
        once; a field given by name wins over it. A wrong value raises FabricError
        (``bad_request``) naming the field, before any socket is used."""
        args = GenerateArgs.of(model, messages=messages, prompt=prompt, max_tokens=max_tokens, stop=stop,
                               ignore_eos=ignore_eos, sampling=sampling, request_id=request_id, api_key=api_key,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        msg = args.message(route or self.route(model))
        return self._resubmitting(model, msg, fixed_route=route is not None)

    def _resubmitting(self, model: str, msg: p.Generate, fixed_route: bool) -> Iterator[p.Event]:
        """Stream ``msg``; if its head dies before the first token, re-submit once on a
        route that avoids it (a head that already streamed tokens fails the request)."""
        try:
            yield from self._stream(msg)
        except HeadDied as died:
            if fixed_route or died.tokens:
                raise
            yield from self._stream(dataclasses.replace(msg, route=self.route(model, (died.head.node,))))

    def _stream(self, msg: p.Generate) -> Iterator[p.Event]:
        poller = zmq.Poller()
        sock, monitor = _open_head(self.ctx, msg, self.security, poller)
        done, tokens = False, 0
        try:
            sock.send_multipart(p.encode(msg))
            while True:
                ready = dict(poller.poll(self.timeout * 1000))
                _head_ready(ready, sock, monitor, msg, tokens)
                event = _check(sock.recv_multipart())
                tokens += event.event == "token"
                done = event.event == "done"
                yield event
                if done:
                    return
        finally:
            if not done:
                sock.send_multipart(p.encode(p.Cancel(msg.request_id)))
            _close_head(sock, monitor, done)

    def chat(self, model: str, prompt: str, **kwargs) -> str:
        """The whole reply to one user message, as text."""
        events = self.generate(model, messages=[{"role": "user", "content": prompt}], **kwargs)
        return "".join(e.text for e in events if e.event == "token")


class AsyncClient(_ClientBase):
    """asyncio client with the same calls as ``Client``."""

    def __init__(self, tracker: str = "tcp://127.0.0.1:5555", *, timeout: float = 30.0,
                 security: Security | None = None):
        super().__init__(tracker, timeout, security, zmq.asyncio.Context.instance())
        self._lock = asyncio.Lock()  # one question at a time on the shared tracker socket

    async def close(self) -> None:
        if self._tracker is not None:
            self._tracker.close(linger=0)
            self._tracker = None

    async def ask(self, message: p.Message) -> p.Message:
        async with self._lock:  # one question in flight on the shared tracker socket
            if self._tracker is None:
                self._tracker = _dealer(self.ctx, self.tracker_endpoint, self.security,
                                        self.security and self.security.tracker_key)
            try:
                await self._tracker.send_multipart(p.encode(message))
                if not await self._tracker.poll(self._tracker_wait_ms):
                    raise _tracker_silent(self.tracker_endpoint)
                return _decode(await self._tracker.recv_multipart())
            except BaseException:
                await self.close()  # a late reply must never answer the next question
                raise

    async def status(self) -> dict:
        reply = await self.ask(p.StatusRequest())
        if not isinstance(reply, p.Status):
            raise FabricError(getattr(reply, "code", p.ErrorCode.INTERNAL), str(reply))
        return reply.body

    async def models(self) -> list[dict]:
        return _models(await self.status())

    async def route(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...]:
        return _route_from(await self.ask(p.RouteRequest(model, exclude)))

    def generate(self, model: str, *, messages=None, prompt=None, max_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = (), ignore_eos: bool = False,
                 sampling: p.Sampling | None = None, request_id: str | None = None,
                 api_key: str | None = None, route: tuple[p.Hop, ...] | None = None) -> AsyncIterator[p.Event]:
        """As ``Client.generate``, for ``async for``; wrong arguments raise here, at the call."""
        args = GenerateArgs.of(model, messages=messages, prompt=prompt, max_tokens=max_tokens, stop=stop,
                               ignore_eos=ignore_eos, sampling=sampling, request_id=request_id, api_key=api_key,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return self._stream(args, route)

    async def _stream(self, args: GenerateArgs, route) -> AsyncIterator[p.Event]:
        """Stream a request; if its head dies before the first token, re-submit once on a
        route that avoids it (a head that already streamed tokens fails the request)."""
        msg = args.message(route or await self.route(args.model))
        try:
            async for event in self._attempt(msg):
                yield event
        except HeadDied as died:
            if route is not None or died.tokens:
                raise
            hops = await self.route(args.model, (died.head.node,))
            async for event in self._attempt(dataclasses.replace(msg, route=hops)):
                yield event

    async def _attempt(self, msg: p.Generate) -> AsyncIterator[p.Event]:
        poller = zmq.asyncio.Poller()
        sock, monitor = _open_head(self.ctx, msg, self.security, poller)
        done, tokens = False, 0
        try:
            await sock.send_multipart(p.encode(msg))
            while True:
                ready = dict(await poller.poll(self.timeout * 1000))
                _head_ready(ready, sock, monitor, msg, tokens)
                event = _check(await sock.recv_multipart())
                tokens += event.event == "token"
                done = event.event == "done"
                yield event
                if done:
                    return
        finally:
            if not done:
                await sock.send_multipart(p.encode(p.Cancel(msg.request_id)))
            _close_head(sock, monitor, done)


def _open_head(ctx, msg: p.Generate, security, poller):
    """DEALER to the request's head, plus a monitor of its link, both on ``poller``."""
    sock = _dealer(ctx, msg.route[0].endpoint, security, msg.route[0].key)
    monitor = sock.get_monitor_socket(HEAD_DOWN)
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    return sock, monitor


def _close_head(sock, monitor, done: bool) -> None:
    # the monitor stops before its reader closes: an event with no reader would block the
    # context's I/O thread, and with it every socket of this process
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=100 if not done else 0)


def _head_ready(ready: dict, sock, monitor, msg: p.Generate, tokens: int) -> None:
    """Raise when the poll says the head died (link down, nothing to read) or went silent."""
    if monitor in ready and sock not in ready:
        raise _died(msg.route[0], tokens)
    if not ready:
        raise FabricError(p.ErrorCode.HOP_FAILED, f"head {msg.route[0].endpoint} went silent")


def _died(head: p.Hop, tokens: int) -> HeadDied:
    died = HeadDied(head)
    died.tokens = tokens  # tokens the client already received from this head
    return died


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout``; for scripts and tests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
