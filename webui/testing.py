"""A fake fabric client with ``fabric.client.AsyncClient``'s interface, for tests.

It speaks the same event sequence as the real client (start, token..., done), raises the
same ``FabricError`` type, honours ``max_tokens``, and records every call and whether each
stream was closed, so tests can check that the web UI cancels what it abandons.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fabric.wire.protocol import ErrorCode, Event, Grammar, Hop, Logprob, Sampling, TokenLogprobs, ToolChoice, Tools

from fabric.client import FabricError


class FakeFabricError(FabricError):
    """A ``FabricError`` (the real one once fabric.client exists) with a known constructor."""

    def __init__(self, code: str, message: str):
        Exception.__init__(self, message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Script:
    """What the fake fabric does for one request."""

    tokens: tuple[str, ...] = ("Hello", ",", " world", "!")
    prompt_tokens: int = 7
    error_before: str | None = None  # an ErrorCode raised before the first event
    raise_on_call: bool = False  # raise error_before from generate() itself, not from the stream
    error_after: int | None = None  # raise hop_failed after this many tokens
    hang_after: int | None = None  # block forever after this many tokens (disconnect tests)
    hang_at_start: bool = False  # block forever before the start event
    prefill: tuple[int, ...] = ()  # progress events before the first token: positions prefilled of prompt_tokens
    tool_syntax: str = "hermes"  # what the start event names when the request offers tools (not "none")


@dataclass(frozen=True)
class GenerateCall:
    model: str
    messages: list[dict] | None
    prompt: str | None
    max_tokens: int
    stop: tuple[str, ...]
    sampling: Sampling
    request_id: str | None
    api_key: str | None
    ignore_eos: bool = False
    fit_context: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)
    response_format: Grammar | None = None
    tools: Tools | None = None
    speculation: bool = True


def fake_logprobs(i: int, text: str, top: int) -> TokenLogprobs:
    """The fake's logprobs of its ``i``-th token: -0.5 * (i + 1), and ``top`` alternatives, the
    token itself first, then ``alt0``, ``alt1``... one nat less likely each."""
    lp = -0.5 * (i + 1)
    alts = [Logprob(200 + j, f"alt{j}", lp - 1.0 - j) for j in range(max(top - 1, 0))]
    return TokenLogprobs(100 + i, text, lp, tuple([Logprob(100 + i, text, lp), *alts][:top]))


class FakeStream:
    """The async iterator ``generate`` returns; records ``aclose``."""

    def __init__(self, call: GenerateCall, script: Script):
        self.call = call
        self.aclosed = False  # aclose() was called
        self.finished = False  # the stream ran to its end
        self.sent: list[Event] = []
        self._events = self._script(script)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Event:
        if self.aclosed:
            raise StopAsyncIteration
        try:
            event = await anext(self._events)
        except StopAsyncIteration:
            self.finished = True
            raise
        self.sent.append(event)
        return event

    async def aclose(self) -> None:
        self.aclosed = True
        await self._events.aclose()

    async def _script(self, script: Script):
        rid = self.call.request_id or "fake"
        if script.error_before:
            raise FakeFabricError(script.error_before, f"fake {script.error_before}")
        if script.hang_at_start:
            await asyncio.Event().wait()
        tools = self.call.tools
        syntax = script.tool_syntax if tools is not None and tools.choice != ToolChoice.NONE else ""
        yield Event(request_id=rid, event="start", route=(Hop("fake-node", "tcp://fake:1", 0, 29),),
                    tool_syntax=syntax)
        for done in script.prefill:
            yield Event(request_id=rid, event="progress", prompt_tokens=script.prompt_tokens, prefilled=done,
                        prefill_tokens=script.prompt_tokens)
        tokens = script.tokens[: self.call.max_tokens]
        for i, text in enumerate(tokens):
            if script.hang_after == i:
                await asyncio.Event().wait()
            if script.error_after == i:
                raise FakeFabricError(ErrorCode.HOP_FAILED, "fake hop failure")
            logprobs = () if self.call.logprobs is None else (fake_logprobs(i, text, self.call.logprobs),)
            yield Event(request_id=rid, event="token", text=text, token_ids=(100 + i,), logprobs=logprobs)
        finish = "length" if len(script.tokens) > self.call.max_tokens else "stop"
        yield Event(request_id=rid, event="done", finish_reason=finish,
                    prompt_tokens=script.prompt_tokens, completion_tokens=len(tokens))


@dataclass
class FakeClient:
    """Stands in for ``fabric.client.AsyncClient``."""

    model_list: list[dict] = field(default_factory=lambda: [
        {"id": "smollm2-135m", "num_layers": 30, "nodes": 2, "routable": True}])
    script: Script = Script()
    models_error: str | None = None  # an ErrorCode models() raises
    status_body: dict = field(default_factory=lambda: {"nodes": [], "plans": {}, "events": [], "stats": {}})
    status_error: str | None = None  # an ErrorCode status() raises
    calls: list[GenerateCall] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    closed: bool = False

    async def models(self) -> list[dict]:
        if self.models_error:
            raise FakeFabricError(self.models_error, f"fake {self.models_error}")
        return [dict(m) for m in self.model_list]

    async def status(self) -> dict:
        if self.status_error:
            raise FakeFabricError(self.status_error, f"fake {self.status_error}")
        return dict(self.status_body)

    def generate(self, model: str, *, messages: list[dict] | None = None, prompt: str | None = None,
                 max_tokens: int = 256, stop: tuple[str, ...] = (), sampling: Sampling = Sampling(),
                 request_id: str | None = None, api_key: str | None = None, ignore_eos: bool = False,
                 fit_context: bool = False, logprobs: int | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, logit_bias: dict | None = None,
                 response_format: Grammar | None = None, tools: Tools | None = None,
                 speculation: bool = True) -> FakeStream:
        call = GenerateCall(model, messages, prompt, max_tokens, stop, sampling, request_id, api_key, ignore_eos,
                            fit_context, logprobs, presence_penalty, frequency_penalty, dict(logit_bias or {}),
                            response_format, tools, speculation)
        self.calls.append(call)
        script = self.script
        if all(m["id"] != model for m in self.model_list):
            script = Script(error_before=ErrorCode.UNKNOWN_MODEL)
        if script.raise_on_call and script.error_before:
            raise FakeFabricError(script.error_before, f"fake {script.error_before}")
        stream = FakeStream(call, script)
        self.streams.append(stream)
        return stream

    async def close(self) -> None:
        self.closed = True
