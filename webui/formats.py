"""The OpenAI response objects: chat.completion(.chunk) and text_completion.

A format knows one request's id, model and creation time and builds every object its
response needs; the streamer and the collector in ``openai_api`` stay format-agnostic.
Logprobs take OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes,
top_logprobs}]}``, and the legacy completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}``. A token's text is the token decoded alone (vLLM's choice): a piece of a
multi-byte character is U+FFFD there, and ``bytes`` are that text's UTF-8.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from fabric.toolcalls import ToolCall
from fabric.wire.protocol import Event, Logprob, TokenLogprobs

from . import sse
from .generation import Completed
from .tool_replies import TOOL_CALLS, ToolReplies, call_deltas
from .tool_replies import finish_reason as tool_finish


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ResponseFormat:
    id: str
    model: str
    include_usage: bool = False  # streamed chunks carry "usage": null, and a usage chunk ends
    logprobs: bool = False  # the request asked for logprobs: choices carry them instead of null
    created: int = field(default_factory=lambda: int(time.time()))

    CHUNK_OBJECT = ""
    OBJECT = ""
    END = sse.DONE  # what ends a stream

    def encode(self, chunk: dict) -> bytes:
        """One streamed chunk on the wire."""
        return sse.event(chunk)

    def error(self, body: dict) -> dict:
        """The chunk that reports a failure mid-stream (an OpenAI error object)."""
        return body

    def opening(self) -> list[dict]:
        """Chunks sent before the first token."""
        return []

    def started(self, event: Event) -> None:
        """The fabric's start event arrived."""

    def deltas(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict]:
        """The chunks of one token event."""
        return [self.delta(text, logprobs)]

    def endings(self, finish_reason: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> list[dict]:
        """The chunks that end the reply (before the usage chunk)."""
        return [self.closing(finish_reason)]

    def delta(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> dict:
        raise NotImplementedError

    def closing(self, finish_reason: str) -> dict:
        raise NotImplementedError

    def whole(self, done: Completed) -> dict:
        raise NotImplementedError

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self._head(self.CHUNK_OBJECT), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass
class ChatFormat(ResponseFormat):
    tools: ToolReplies | None = None  # the request offered functions: the reply is parsed for calls

    CHUNK_OBJECT = "chat.completion.chunk"
    OBJECT = "chat.completion"

    def opening(self) -> list[dict]:
        return [self._choice({"role": "assistant", "content": ""}, None)]

    def started(self, event: Event) -> None:
        if self.tools is not None:
            self.tools.start(event.tool_syntax)

    def deltas(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict]:
        if self.tools is None or not self.tools.parsing:
            return [self.delta(text, logprobs)]
        return self._pieces(self.tools.feed(text), logprobs)

    def endings(self, finish_reason: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> list[dict]:
        if self.tools is None:
            return [self.closing(finish_reason)]
        chunks = self._pieces(self.tools.finish())
        return chunks + [self.closing(tool_finish(finish_reason, self.tools.called))]

    def _pieces(self, pieces: list, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict]:
        """Chunks of parsed text: content deltas (the first carries the token's logprobs) and
        each call's deltas; logprobs of text held back go out on an empty content delta."""
        chunks, index = [], self.tools.called - sum(isinstance(p, ToolCall) for p in pieces)
        for piece in pieces:
            if isinstance(piece, ToolCall):
                chunks += [self._choice(d, None) for d in call_deltas(index, piece)]
                index += 1
            else:
                chunks.append(self.delta(piece.text, logprobs))
                logprobs = ()
        if logprobs:
            chunks.append(self.delta("", logprobs))
        return chunks

    def delta(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> dict:
        return self._choice({"content": text}, None, self._logprobs(logprobs) if logprobs else None)

    def closing(self, finish_reason: str) -> dict:
        return self._choice({}, finish_reason)

    def whole(self, done: Completed) -> dict:
        message = {"role": "assistant", "content": done.text}
        finish = done.finish_reason
        if self.tools is not None and (found := self.tools.whole(done.text, done.tool_syntax))[1]:
            message = {"role": "assistant", "content": found[0], TOOL_CALLS: found[1]}
            finish = tool_finish(finish, len(found[1]))
        choice = {"index": 0, "message": message,
                  "logprobs": self._logprobs(done.logprobs) if self.logprobs else None, "finish_reason": finish}
        return {**self._head(self.OBJECT), "choices": [choice],
                "usage": usage(done.prompt_tokens, done.completion_tokens)}

    def _choice(self, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return self._chunk({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    @staticmethod
    def _logprobs(logprobs: Sequence[TokenLogprobs]) -> dict:
        return {"content": [{**_chat_entry(lp), "top_logprobs": [_chat_entry(t) for t in lp.top]}
                            for lp in logprobs]}


def _chat_entry(lp: Logprob) -> dict:
    return {"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.text.encode("utf-8", "replace"))}


class TextFormat(ResponseFormat):
    CHUNK_OBJECT = "text_completion"  # OpenAI streams text_completion objects too
    OBJECT = "text_completion"

    text_offset: int = 0  # characters of the token texts reported so far: the next token's text_offset

    def delta(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> dict:
        return self._chunk(self._choice(text, None, self._logprobs(logprobs) if logprobs else None))

    def closing(self, finish_reason: str) -> dict:
        return self._chunk(self._choice("", finish_reason))

    def whole(self, done: Completed) -> dict:
        logprobs = self._logprobs(done.logprobs) if self.logprobs else None
        return {**self._head(self.OBJECT), "choices": [self._choice(done.text, done.finish_reason, logprobs)],
                "usage": usage(done.prompt_tokens, done.completion_tokens)}

    def _logprobs(self, logprobs: Sequence[TokenLogprobs]) -> dict:
        """The legacy shape. ``top_logprobs`` maps texts to logprobs, likeliest first, and always
        holds the sampled token (as OpenAI's); ``text_offset`` counts from the reply's start in
        the tokens' own texts, across a stream's chunks (as vLLM's without echo)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            top: dict[str, float] = {}
            for alt in (*lp.top, lp):  # two ids of one text keep the likelier's number
                top.setdefault(alt.text, alt.logprob)
            out["tokens"].append(lp.text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(lp.text)
        return out

    @staticmethod
    def _choice(text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
