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

import threading
from typing import Iterator, Sequence

import zmq

from ..net.security import Security
from ..wire import protocol as p
from ..wire.liveness import DEFAULT_TRACKER
from .core import ClientCore, GenerateArgs, Program, T
from .stream import RequestStream


class Client(ClientCore):
    """Blocking client. ``generate(route=...)`` skips the tracker and uses that route. Every
    decision is ``ClientCore``'s; this shell only does the I/O (``_run``)."""

    def __init__(self, tracker: str = DEFAULT_TRACKER, *, timeout: float = 30.0,
                 security: Security | None = None):
        super().__init__(tracker, timeout, security, zmq.Context.instance(), poller=zmq.Poller,
                         lock=threading.Lock())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._drop_tracker()

    def ask(self, message: p.Message) -> p.Message:
        """One request/reply with the tracker."""
        return self._run(self._ask_program(message))

    def status(self) -> dict:
        return self._run(self._status_program())

    def models(self) -> list[dict]:
        """The models the tracker lists; while it is away, those of the remembered routes."""
        return self._run(self._models_program())

    def route(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...]:
        """The tracker's best route around ``exclude``; while it is away, a remembered one."""
        return self._run(self._route_program(model, exclude))

    def generate(self, model: str, *, messages=None, prompt=None, max_tokens: int = 256,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stop: str | Sequence[str] | None = (), ignore_eos: bool = False,
                 sampling: p.Sampling | None = None, request_id: str | None = None,
                 api_key: str | None = None, route: tuple[p.Hop, ...] | None = None,
                 fit_context: bool = False, logprobs: int | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, logit_bias: dict | None = None,
                 response_format: dict | p.Grammar | None = None, tools: list[dict] | None = None,
                 tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                 speculation: bool = True) -> Iterator[p.Event]:
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
        turns the text into calls; "required" or a named function constrains it to calls.
        ``speculation`` False: the head sends one token a step, never drafts (the text is the same
        either way; drafting only changes how many tokens one trip through the hops yields). A
        wrong value raises FabricError (``bad_request``) naming the field at the call; the route
        is asked for at the first event, so a model no route serves raises there (as in
        ``AsyncClient``)."""
        args = GenerateArgs.of(model, messages=messages, prompt=prompt, max_tokens=max_tokens, stop=stop,
                               ignore_eos=ignore_eos, sampling=sampling, request_id=request_id, api_key=api_key,
                               fit_context=fit_context, logprobs=logprobs, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                               response_format=response_format, tools=tools, tool_choice=tool_choice,
                               parallel_tool_calls=parallel_tool_calls, speculation=speculation,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return self._events(RequestStream(self, args, route))

    def _events(self, stream: RequestStream) -> Iterator[p.Event]:
        try:
            while (event := self._run(stream.next_event())) is not None:
                yield event
        finally:  # a break, an error, a Ctrl-C: the request is cancelled along the route
            self._run(stream.end())

    @staticmethod
    def _run(program: Program[T]) -> T:
        """Do each Call ``program`` yields, and give it the result (or throw it the error)."""
        result, error = None, None
        while True:
            try:
                call = program.send(result) if error is None else program.throw(error)
            except StopIteration as done:
                return done.value
            try:
                result, error = getattr(call.target, call.method)(*call.args), None
            except BaseException as exc:  # the program decides what an error means, a Ctrl-C's too
                result, error = None, exc

    def chat(self, model: str, prompt: str, **kwargs) -> str:
        """The whole reply to one user message, as text."""
        events = self.generate(model, messages=[{"role": "user", "content": prompt}], **kwargs)
        return "".join(e.text for e in events if e.event == p.EventKind.TOKEN)

