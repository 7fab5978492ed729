"""The OpenAI response objects: chat.completion(.chunk) and text_completion.

A format knows one request's id, model and creation time and builds every object its
response needs; the streamer and the collector in ``openai_api`` stay format-agnostic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .generation import Completed


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class ResponseFormat:
    id: str
    model: str
    include_usage: bool = False  # streamed chunks carry "usage": null, and a usage chunk ends
    created: int = field(default_factory=lambda: int(time.time()))

    CHUNK_OBJECT = ""
    OBJECT = ""

    def opening(self) -> list[dict]:
        """Chunks sent before the first token."""
        return []

    def delta(self, text: str) -> dict:
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

    def delta(self, text: str) -> dict:
        return self._choice({"content": text}, None)

    def closing(self, finish_reason: str) -> dict:
        return self._choice({}, finish_reason)

    def whole(self, done: Completed) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "logprobs": None, "finish_reason": done.finish_reason}
        return {**self._head(self.OBJECT), "choices": [choice],
                "usage": usage(done.prompt_tokens, done.completion_tokens)}

    def _choice(self, delta: dict, finish_reason: str | None) -> dict:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason})


class TextFormat(ResponseFormat):
    CHUNK_OBJECT = "text_completion"  # OpenAI streams text_completion objects too
    OBJECT = "text_completion"

    def delta(self, text: str) -> dict:
        return self._chunk(self._choice(text, None))

    def closing(self, finish_reason: str) -> dict:
        return self._chunk(self._choice("", finish_reason))

    def whole(self, done: Completed) -> dict:
        return {**self._head(self.OBJECT), "choices": [self._choice(done.text, done.finish_reason)],
                "usage": usage(done.prompt_tokens, done.completion_tokens)}

    @staticmethod
    def _choice(text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
