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

from fabric.wire.protocol import Logprob, TokenLogprobs

from .generation import Completed


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

    def opening(self) -> list[dict]:
        """Chunks sent before the first token."""
        return []

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


class ChatFormat(ResponseFormat):
    CHUNK_OBJECT = "chat.completion.chunk"
    OBJECT = "chat.completion"

    def opening(self) -> list[dict]:
        return [self._choice({"role": "assistant", "content": ""}, None)]

    def delta(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> dict:
        return self._choice({"content": text}, None, self._logprobs(logprobs) if logprobs else None)

    def closing(self, finish_reason: str) -> dict:
        return self._choice({}, finish_reason)

    def whole(self, done: Completed) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "logprobs": self._logprobs(done.logprobs) if self.logprobs else None,
                  "finish_reason": done.finish_reason}
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
