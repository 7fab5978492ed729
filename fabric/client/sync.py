"""The blocking client, a thin shell over ``core``.

    from fabric import Client
    with Client("tcp://127.0.0.1:5555") as c:
        for event in c.generate("smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                temperature=0.7, top_k=40, seed=1, stop=["\\n\\n"]):
            print(event.text, end="", flush=True)

Closing a generation early (break, or ``close()``) cancels the request along the route,
and every hop frees its KV.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import zmq

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


class Client(ClientCore):
    """Blocking client. ``generate(route=...)`` skips the tracker and uses that route."""

    def __init__(self, tracker: str = DEFAULT_TRACKER, *, timeout: float = 30.0,
                 security: Security | None = None):
        super().__init__(tracker, timeout, security, zmq.Context.instance())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._drop_tracker()

    def ask(self, message: p.Message) -> p.Message:
        """One request/reply with the tracker."""
        sock = self._tracker_socket()
        try:
            sock.send_multipart(p.encode(message), zmq.NOBLOCK)
            if not sock.poll(self._tracker_wait_ms):
                raise self._silent()
            return self._answered(decode_reply(sock.recv_multipart()))
        except zmq.Again:  # no link to the tracker can take it (a refused handshake, say)
            raise self._silent() from None
        except BaseException:
            self._drop_tracker()
            raise

    def status(self) -> dict:
        return self._status(self.ask(p.StatusRequest()))

    def models(self) -> list[dict]:
        """The models the tracker lists; while it is away, those of the remembered routes."""
        try:
            return models_of(self.status())
        except FabricError as exc:
            return self._remembered_models(exc)

    def route(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...]:
        """The tracker's best route around ``exclude``; while it is away, a remembered one."""
        try:
            return self._routed(model, route_from(self.ask(p.RouteRequest(model, exclude))))
        except FabricError as exc:
            return self._remembered(model, exclude, exc)

    def generate(self, model: str, *, messages=None, prompt=None, max_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = (), ignore_eos: bool = False,
                 sampling: p.Sampling | None = None, request_id: str | None = None,
                 api_key: str | None = None, route: tuple[p.Hop, ...] | None = None,
                 fit_context: bool = False, logprobs: int | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, logit_bias: dict | None = None,
                 response_format: dict | p.Grammar | None = None, tools: list[dict] | None = None,
                 tool_choice: str | dict | None = None,
                 parallel_tool_calls: bool | None = None) -> Iterator[p.Event]:
        """Stream the events of one request: a chat (``messages``, OpenAI's role/content maps)
        or a raw ``prompt``. The sampling fields are OpenAI's (``top_k`` and ``ignore_eos`` as
        vLLM's): temperature 0 (the default) is greedy, ``top_k`` 0 and ``top_p`` 1 cut nothing,
        and a ``seed`` makes sampling repeatable. ``stop`` is a string or a list of them; the
        reply ends before the first one. ``sampling`` (a ``Sampling``) sets all four fields at
        once; a field given by name wins over it. A prompt plus ``max_tokens`` beyond the model's
        context is refused, unless ``fit_context``: then fewer tokens come, as many as it leaves.
        With ``logprobs`` (0..20) each token event carries ``event.logprobs``: the token's
        log-probability under the model (the log-softmax of the raw logits it was sampled from)
        and that many likeliest alternatives (``protocol.TokenLogprobs``). ``presence_penalty``,
        ``frequency_penalty`` (-2..2) and ``logit_bias`` ({token id: -100..100}) are OpenAI's,
        applied at the tail to the logits it samples from. ``response_format`` is OpenAI's
        ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}}) or a
        ``protocol.Grammar`` (a regex, a Lark grammar too): the tail masks every token it forbids,
        and the reply ends when it is complete. ``tools``, ``tool_choice`` and
        ``parallel_tool_calls`` are OpenAI's: the start event's ``tool_syntax`` names how the
        reply writes calls, and ``fabric.toolcalls.parse_reply(text, SYNTAXES[syntax], names)``
        turns the text into calls; "required" or a named function constrains it to calls. A wrong value raises
        FabricError (``bad_request``) naming the field, and a model no route serves raises, both
        at the call."""
        args = GenerateArgs.of(model, messages=messages, prompt=prompt, max_tokens=max_tokens, stop=stop,
                               ignore_eos=ignore_eos, sampling=sampling, request_id=request_id, api_key=api_key,
                               fit_context=fit_context, logprobs=logprobs, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                               response_format=response_format, tools=tools, tool_choice=tool_choice,
                               parallel_tool_calls=parallel_tool_calls,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return self._stream(model, args.message(route or self.route(model)), fixed_route=route is not None)

    def _stream(self, model: str, msg: p.Generate, fixed_route: bool) -> Iterator[p.Event]:
        """Stream ``msg``; when its head dies, the request goes on at another (``Continuation``)."""
        stream = Continuation(msg, fixed_route)
        while True:
            try:
                with contextlib.closing(self._attempt(stream.msg)) as events:
                    for event in events:
                        if stream.passes(event):
                            yield event
                return
            except HeadGone as died:
                stream.go_on(died, self._route_around(model, died, stream))

    def _route_around(self, model: str, died: HeadGone, stream: Continuation) -> tuple[p.Hop, ...]:
        for exclude in self._around(died, stream):
            try:
                return self.route(model, exclude)
            except FabricError as exc:
                why = exc
        raise stranded(died, why) from None

    def _attempt(self, msg: p.Generate) -> Iterator[p.Event]:
        poller = zmq.Poller()
        head = HeadLink(self.ctx, msg, self.security, poller)
        try:
            head.sock.send_multipart(head.request)
            while not head.done:
                head.check(dict(poller.poll(self.timeout * 1000)))
                yield head.take(head.sock.recv_multipart())
        finally:
            if not head.done:
                head.sock.send_multipart(head.cancel)
            head.close()

    def chat(self, model: str, prompt: str, **kwargs) -> str:
        """The whole reply to one user message, as text."""
        events = self.generate(model, messages=[{"role": "user", "content": prompt}], **kwargs)
        return "".join(e.text for e in events if e.event == p.EventKind.TOKEN)

