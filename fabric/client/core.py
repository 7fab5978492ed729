"""The client's one core: what a request is, what the tracker's and a head's answers mean,
and every call as a program (``Program``) that yields the I/O it needs (``Call``) and decides
on what comes back. No I/O of its own: ``Client`` (blocking, in ``sync.py``) and
``AsyncClient`` (asyncio, in ``aio.py``) are thin shells that do the Calls, so both behave
alike by construction. A request's stream of events is ``stream.RequestStream``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Generator, TypeVar

import msgpack
import zmq

from ..net.security import Security, SecurityError, dial, dial_watched
from ..toolcalls.request import ToolsError, tools_of
from ..wire import protocol as p
from ..wire.liveness import TRACKER_SILENCE
from .routes import RouteBook

log = logging.getLogger(__name__)


class FabricError(Exception):
    """The fabric refused or failed a request. ``code`` is a ``protocol.ErrorCode`` value."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


TRACKER_TIMEOUT = TRACKER_SILENCE  # a running tracker answers at once: waiting longer only delays the error
TRACKER_RETRY = 0.5  # after a silence the tracker gets this long before a remembered route is used instead


def _tracker_silent(endpoint: str) -> FabricError:
    return FabricError(p.ErrorCode.TRACKER_UNAVAILABLE,
                       f"tracker at {endpoint} did not answer (is it running? a secured swarm needs --keys)")


class HeadGone(FabricError):
    """The head can no longer carry the request, which goes on at another head (``Continuation``).
    Callers that mean any such head catch this; each kind books its head in the client's
    ``RouteBook`` as what it is (``book``)."""

    def __init__(self, head: p.Hop, code: str, message: str):
        super().__init__(code, message)
        self.head = head

    def book(self, routes: RouteBook) -> None:
        raise NotImplementedError


class HeadDied(HeadGone):
    """The connection to the head dropped: its process is gone."""

    def __init__(self, head: p.Hop):
        super().__init__(head, p.ErrorCode.HOP_FAILED, f"the head {head.node} at {head.endpoint} died")

    def book(self, routes: RouteBook) -> None:
        routes.died(self.head.node)


class HeadSilent(HeadDied):
    """The head sent nothing for the client's whole timeout (hung, or cut off): the request
    goes on at another head, as after a death; the silent one is told to cancel it."""

    def __init__(self, head: p.Hop):
        HeadGone.__init__(self, head, p.ErrorCode.HOP_FAILED, f"the head {head.node} at {head.endpoint} went silent")


class HeadLeaving(HeadGone):
    """The head refused the request because it is leaving the swarm: go to another. It is
    alive and finishing what it serves, so it is booked as leaving, not as dead."""

    def __init__(self, head: p.Hop, message: str):
        super().__init__(head, p.ErrorCode.LEAVING, message)

    def book(self, routes: RouteBook) -> None:
        routes.left(self.head.node)


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
    fit_context: bool = False
    logprobs: int = -1  # token events carry logprobs with this many alternatives; -1: none
    penalties: p.Penalties | None = None  # presence/frequency penalties and logit_bias; None: none
    grammar: p.Grammar | None = None  # what the reply must match (response_format); None: free text
    tools: p.Tools | None = None  # functions offered to the chat; None: none
    speculation: bool = True  # False: the head never drafts for this request (one token a step)

    @classmethod
    def of(cls, model: str, *, messages=None, prompt=None, max_tokens=256, stop=(), ignore_eos=False,
           sampling: p.Sampling | None = None, request_id=None, api_key=None, fit_context=False,
           logprobs=None, presence_penalty=None, frequency_penalty=None, logit_bias=None,
           response_format=None, tools=None, tool_choice=None, parallel_tool_calls=None, speculation=True,
           **fields) -> GenerateArgs:
        """The arguments of ``generate``; ``fields`` (temperature, top_k, top_p, seed) override
        ``sampling``'s, None keeping it. A wrong type or value is a FabricError (bad_request)
        naming the field, with the limits of ``protocol``, before any socket is used. ``tools``,
        ``tool_choice`` and ``parallel_tool_calls`` are OpenAI's; the start event then names the
        syntax the reply's calls are written in (``fabric.toolcalls.parse_reply`` reads them)."""
        if unknown := set(fields) - set(SAMPLING_FIELDS):
            raise TypeError(f"generate() got unexpected keyword arguments {sorted(unknown)}")
        chosen = {name: value for name, value in fields.items() if value is not None}
        args = cls(model, _messages(messages), prompt, max_tokens, _stops(stop),
                   dataclasses.replace(sampling or p.Sampling(), **chosen), request_id or uuid.uuid4().hex,
                   p.key_id(api_key), ignore_eos, bool(fit_context), -1 if logprobs is None else logprobs,
                   penalties_of(presence_penalty, frequency_penalty, logit_bias), _grammar(response_format),
                   _tools(tools, tool_choice, parallel_tool_calls), speculation)
        args.message(_ANY_ROUTE)
        return args

    def message(self, route: tuple[p.Hop, ...]) -> p.Generate:
        """The GENERATE for ``route``, as the head will read it."""
        return _as_the_head_reads(p.Generate(
            request_id=self.request_id, route=tuple(route), messages=self.messages, prompt=self.prompt,
            max_tokens=self.max_tokens, stop=self.stop, sampling=self.sampling, api_key=self.api_key,
            ignore_eos=self.ignore_eos, fit_context=self.fit_context, logprobs=self.logprobs,
            penalties=self.penalties, grammar=self.grammar, tools=self.tools, speculation=self.speculation))


def penalties_of(presence, frequency, logit_bias) -> p.Penalties | None:
    """OpenAI's presence_penalty, frequency_penalty and logit_bias ({token id: bias}, ids as ints
    or as the decimal strings JSON gives) as one ``Penalties``; None when they ask for nothing.
    Ranges are checked where the head checks them (``_as_the_head_reads``)."""
    bias = dict(logit_bias or {})
    ids = tuple(int(k) if isinstance(k, str) and k.isdecimal() else k for k in bias)
    if not presence and not frequency and not bias:
        return None
    return p.Penalties(presence or 0.0, frequency or 0.0, ids, tuple(bias.values()))


def grammar_of(response_format) -> p.Grammar | None:
    """OpenAI's ``response_format`` ({"type": "text"}, {"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": {...}}}) as a ``Grammar``; a ``Grammar`` as it is.
    ValueError says what is wrong; the schema itself is checked where the head checks it."""
    if response_format is None or isinstance(response_format, p.Grammar):
        return response_format
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == p.GrammarKind.JSON_OBJECT:
        return p.Grammar(p.GrammarKind.JSON_OBJECT)
    if kind != p.GrammarKind.JSON_SCHEMA:
        raise ValueError('response_format type must be "text", "json_object" or "json_schema"')
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise ValueError('response_format json_schema must be an object whose "schema" is a JSON schema')
    source = json.dumps(spec.get("schema", {}), separators=(",", ":"))
    if len(source) > p.MAX_GRAMMAR:
        raise ValueError(f"response_format json_schema: the schema has more than {p.MAX_GRAMMAR} characters")
    return p.Grammar(p.GrammarKind.JSON_SCHEMA, source)


def _grammar(response_format) -> p.Grammar | None:
    try:
        return grammar_of(response_format)
    except ValueError as exc:
        raise _bad(str(exc)) from None


def _tools(tools, tool_choice, parallel_tool_calls) -> p.Tools | None:
    try:
        return tools_of(tools, tool_choice, parallel_tool_calls)
    except ToolsError as exc:
        raise _bad(str(exc)) from None


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
            if f.name in ("route", "sampling", "tensors", "penalties", "grammar", "tools"):
                continue
            try:
                msgpack.packb(value)
            except (TypeError, ValueError, OverflowError):
                return _bad(f"{f.name} cannot be sent: {value!r:.80}")
    return _bad(f"the request cannot be sent: {exc}")


def route_from(reply: p.Message) -> tuple[p.Hop, ...]:
    if isinstance(reply, p.Route):
        return reply.hops
    if isinstance(reply, p.Error):
        raise FabricError(reply.code, reply.message)
    raise FabricError(p.ErrorCode.INTERNAL, f"tracker answered {type(reply).__name__}")


def decode_reply(frames) -> p.Message:
    """Decode a reply; a peer speaking another protocol is a FabricError too."""
    try:
        return p.decode(frames)[0]
    except p.ProtocolError as exc:
        raise FabricError(exc.code, f"bad reply: {exc}") from None


def event_of(frames) -> p.Event:
    """An event from the head, or the FabricError it stands for."""
    event = decode_reply(frames)
    if isinstance(event, p.Error):
        raise FabricError(event.code, event.message)
    if not isinstance(event, p.Event):
        raise FabricError(p.ErrorCode.INTERNAL, f"head sent {type(event).__name__}")
    if event.event == p.EventKind.ERROR:
        raise FabricError(event.error_code or p.ErrorCode.INTERNAL, event.text)
    return event


def models_of(status: dict) -> list[dict]:
    """The models nodes serve, each with its layer count, nodes, and whether a route covers it."""
    by_model: dict[str, dict] = {}
    for node in status.get("nodes", []):
        entry = by_model.setdefault(node["model"], {"id": node["model"], "num_layers": node.get("num_layers"),
                                                    "nodes": 0, "routable": False})
        entry["nodes"] += 1
    for model, plans in status.get("plans", {}).items():
        if model in by_model and plans:
            by_model[model]["routable"] = True
    return sorted(by_model.values(), key=lambda m: m["id"])


def dealer(ctx, endpoint: str, security: Security | None = None, server_key: str | bytes | None = None,
            watch: int = 0):
    """A DEALER to ``endpoint`` (and, given ``watch`` events, its monitor); a FabricError if
    it cannot be dialled."""
    try:
        if watch:
            return dial_watched(ctx, endpoint, security, server_key, watch, sndhwm=None)
        return dial(ctx, endpoint, security, server_key, sndhwm=None)
    except (zmq.ZMQError, SecurityError) as exc:
        raise FabricError(p.ErrorCode.BAD_REQUEST, f"cannot dial {endpoint!r}: {exc}") from None


def status_body(reply: p.Message) -> dict:
    if not isinstance(reply, p.Status):
        raise FabricError(getattr(reply, "code", p.ErrorCode.INTERNAL), str(reply))
    return reply.body


@dataclass(frozen=True)
class Call:
    """One piece of I/O a program asks its shell for: ``target.method(*args)``, a socket's
    ``send_multipart``, ``poll`` or ``recv_multipart``, a poller's ``poll``, a lock's
    ``acquire``. The blocking and asyncio sockets, pollers and locks name these alike, so the
    blocking shell calls it and the asyncio shell calls it and awaits what is awaitable. What it
    returns, or the exception it raises, goes back into the program."""

    target: Any
    method: str
    args: tuple = ()


T = TypeVar("T")
Program = Generator[Call, Any, T]  # every decision of a call; its shell does the Calls it yields


class ClientCore:
    """What both clients hold and decide: where the tracker is, how long to wait, which keys to
    use, the DEALER to the tracker (made on first use, dropped after any failure so that a late
    reply never answers the next question), and the calls as programs (``Program``) that a shell
    drives with ``_run``: the shells differ only in how they do a ``Call``.

    ``lock`` lets one question at a time use the tracker socket (a ``threading.Lock`` or an
    ``asyncio.Lock``: both ``acquire`` by a Call and ``release`` at once); ``poller`` makes the
    poller a head's link is watched with."""

    def __init__(self, tracker: str, timeout: float, security: Security | None, ctx, *, poller, lock):
        self.tracker_endpoint = tracker
        self.timeout = timeout  # seconds to wait for the head's next event, or the tracker (TRACKER_TIMEOUT at most)
        self.security = security  # CurveZMQ keys for a secured swarm; None: plaintext
        self.ctx = ctx
        self.poller = poller  # zmq.Poller or zmq.asyncio.Poller, to the shell's sockets
        self._lock = lock  # one question at a time on the shared tracker socket
        self._tracker = None
        self.routes = RouteBook()  # the last routes and plans seen: used while the tracker is away
        self._silent_since: float | None = None  # when the tracker last failed to answer (None: it answers)
        self._said_remembered = False  # the fallback to remembered routes was logged in this silence

    def _ask_program(self, message: p.Message) -> Program[p.Message]:
        """One request/reply with the tracker, under the lock."""
        yield Call(self._lock, "acquire")
        try:
            sock = self._tracker_socket()
            try:
                yield Call(sock, "send_multipart", (p.encode(message), zmq.NOBLOCK))
                if not (yield Call(sock, "poll", (self._tracker_wait_ms,))):
                    raise self._silent()
                return self._answered(decode_reply((yield Call(sock, "recv_multipart"))))
            except zmq.Again:  # no link to the tracker can take it (a refused handshake, say)
                raise self._silent() from None
            except BaseException:  # a cancelled question too: its late reply must not answer the next
                self._drop_tracker()
                raise
        finally:
            self._lock.release()

    def _status_program(self) -> Program[dict]:
        body = status_body((yield from self._ask_program(p.StatusRequest())))
        self.routes.learn_plans(body)
        return body

    def _models_program(self) -> Program[list[dict]]:
        """The models the tracker lists; while it is away, those of the remembered routes."""
        try:
            return models_of((yield from self._status_program()))
        except FabricError as exc:
            if exc.code not in p.TRACKER_AWAY_CODES or not self.routes.models():
                raise
            return self.routes.models()

    def _route_program(self, model: str, exclude: tuple[str, ...] = ()) -> Program[tuple[p.Hop, ...]]:
        """The tracker's best route around ``exclude``, remembered; while it is away, a remembered one."""
        try:
            hops = route_from((yield from self._ask_program(p.RouteRequest(model, exclude))))
        except FabricError as exc:
            return self._remembered(model, exclude, exc)
        self.routes.learn(model, hops)
        return hops

    def _tracker_socket(self):
        if self._tracker is None:
            self._tracker = dealer(self.ctx, self.tracker_endpoint, self.security,
                                   self.security and self.security.tracker_key)
        return self._tracker

    def _drop_tracker(self) -> None:
        if self._tracker is not None:
            self._tracker.close(linger=0)
            self._tracker = None

    @property
    def _tracker_wait_ms(self) -> float:
        wait = min(self.timeout, TRACKER_TIMEOUT)
        if self._silent_since is not None and self.routes:  # a remembered route stands by: do not keep it waiting
            wait = min(wait, TRACKER_RETRY)
        return wait * 1000

    def _silent(self) -> FabricError:
        self._drop_tracker()
        self._silent_since = time.monotonic()
        return _tracker_silent(self.tracker_endpoint)

    def learn_plans(self, plans: dict) -> None:
        """Remember the routes of a tracker's ``plans`` publication (the web UI's live feed
        calls this), to use while the tracker is away."""
        self.routes.learn_plans(plans)

    def _answered(self, reply: p.Message) -> p.Message:
        self._silent_since, self._said_remembered = None, False
        return reply

    def _remembered(self, model: str, exclude: tuple[str, ...], error: FabricError) -> tuple[p.Hop, ...]:
        """A remembered route of ``model`` when the tracker did not answer; else ``error``."""
        route = self.routes.instead(model, exclude) if error.code in p.TRACKER_AWAY_CODES else None
        if route is None:
            raise error
        said, self._said_remembered = self._said_remembered, True  # said once while the tracker is away
        log.log(logging.DEBUG if said else logging.WARNING, "%s: using a remembered route for %s (%s)",
                error.message, model, " > ".join(h.node for h in route))
        return route
