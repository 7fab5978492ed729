"""The Responses API's objects: a ``response`` whole, or its stream of named events.

The reply is parsed exactly as a chat reply is (``ChatFormat``, tool calls included), and its
pieces are written as the Responses API writes them: output items, a ``message`` whose
``output_text`` part holds the text, and a ``function_call`` item for each call. Streamed, each
piece is an SSE event named by its ``type``: ``response.created``, ``response.in_progress``,
an item's ``added``, its deltas and its ``done`` events, then ``response.completed``, whose
response says ``"status": "incomplete"`` when ``max_output_tokens`` cut the reply (as vLLM
sends it: the SDK's stream helpers wait for that event). No ``[DONE]`` follows, as with OpenAI.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, Sequence

from fabric.wire.protocol import Event, TokenLogprobs

from . import sse
from .formats import ChatFormat
from .generation import Completed
from .tool_replies import TOOL_CALLS


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def text_item(text: str, status: str = "completed", item_id: str = "") -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def call_item(call: dict, status: str = "completed", item_id: str = "") -> dict:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


@dataclass
class ResponsesFormat:
    """One response: its echo of the request (``settings``), and the chat format it reads the reply by."""

    chat: ChatFormat  # its id, model and creation time are the response's
    settings: dict = field(default_factory=dict)  # what the response object repeats of the request
    keep: Callable[[list[dict]], None] | None = None  # given the output items of a response that completed
    include_usage: bool = False  # stream_events asks; the completed event always carries usage
    _seq: int = 0
    _items: list = field(default_factory=list)  # streamed output items so far, the last maybe open
    _open: dict | None = None  # the item being streamed: {"kind", "index", "id", "text", "item"}

    @property
    def id(self) -> str:
        return self.chat.id

    @property
    def model(self) -> str:
        return self.chat.model

    @property
    def created(self) -> int:
        return self.chat.created

    # -- whole ---------------------------------------------------------------------------

    def whole(self, done: Completed) -> dict:
        choice = self.chat.whole(done)["choices"][0]
        message = choice["message"]
        output = [text_item(message["content"])] if message.get("content") else []
        output += [call_item(call) for call in message.get(TOOL_CALLS, ())]
        if self.keep is not None:
            self.keep(output)
        return self._response("completed", output, choice["finish_reason"], done.prompt_tokens,
                              done.completion_tokens)

    def _response(self, status: str, output: list, finish: str | None = None, prompt: int = 0,
                  completion: int = 0) -> dict:
        incomplete = finish == "length"
        out = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
               "status": "incomplete" if incomplete else status, "output": output, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
               "usage": None, **self.settings}
        if status != "in_progress":
            out["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + completion}
        return out

    # -- streamed (the interface stream_events drives) -----------------------------------

    def encode(self, event: dict) -> bytes:
        self._seq += 1
        return sse.event({**event, "sequence_number": self._seq}, name=event["type"])

    END = b""  # nothing after the last event

    def error(self, body: dict) -> dict:
        return {"type": "error", **body["error"]}

    def opening(self) -> list[dict]:
        response = self._response("in_progress", [])
        return [{"type": "response.created", "response": response},
                {"type": "response.in_progress", "response": response}]

    def started(self, event: Event) -> None:
        self.chat.started(event)

    def deltas(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict]:
        return [e for chunk in self.chat.deltas(text) for e in self._events(chunk["choices"][0]["delta"])]

    def endings(self, finish_reason: str, prompt: int = 0, completion: int = 0) -> list[dict]:
        chunks = self.chat.endings(finish_reason)
        events = [e for chunk in chunks[:-1] for e in self._events(chunk["choices"][0]["delta"])]
        events += self._close()
        finish = chunks[-1]["choices"][0]["finish_reason"]
        response = self._response("completed", self._items, finish, prompt, completion)
        if self.keep is not None:
            self.keep(self._items)
        return events + [{"type": "response.completed", "response": response}]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        raise NotImplementedError  # include_usage is False: the last event carries the usage

    def _events(self, delta: dict) -> list[dict]:
        """The events of one chat delta: text to the open message, a call as an item of its own."""
        events = []
        if delta.get("content"):
            if self._open is None or self._open["kind"] != "message":
                events += self._close() + self._begin("message", text_item("", "in_progress"))
            self._open["text"] += delta["content"]
            events.append({**self._where(), "content_index": 0, "type": "response.output_text.delta",
                           "delta": delta["content"], "logprobs": []})
        for call in delta.get(TOOL_CALLS, ()):
            if "id" in call:  # a call's first delta: who is called
                whole = {"id": call["id"], "function": {"name": call["function"]["name"], "arguments": ""}}
                events += self._close() + self._begin("call", call_item(whole, "in_progress"))
            elif arguments := call["function"].get("arguments"):
                self._open["text"] += arguments
                events.append({**self._where(), "type": "response.function_call_arguments.delta",
                               "delta": arguments})
        return events

    def _begin(self, kind: str, item: dict) -> list[dict]:
        self._open = {"kind": kind, "index": len(self._items), "id": item["id"], "text": "", "item": item}
        self._items.append(item)
        events = [{"type": "response.output_item.added", "output_index": self._open["index"], "item": item}]
        if kind == "message":
            events.append({**self._where(), "type": "response.content_part.added", "content_index": 0,
                           "part": text_part("")})
        return events

    def _close(self) -> list[dict]:
        """The done events of the item being streamed, which is then whole in ``_items``."""
        if self._open is None:
            return []
        o, where = self._open, self._where()
        self._open = None
        if o["kind"] == "message":
            item = text_item(o["text"], item_id=o["id"])
            events = [{**where, "content_index": 0, "type": "response.output_text.done", "text": o["text"],
                       "logprobs": []},
                      {**where, "content_index": 0, "type": "response.content_part.done", "part": item["content"][0]}]
        else:
            item = {**o["item"], "arguments": o["text"], "status": "completed"}
            events = [{**where, "type": "response.function_call_arguments.done", "arguments": o["text"]}]
        self._items[o["index"]] = item
        return events + [{"type": "response.output_item.done", "output_index": o["index"], "item": item}]

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": self._open["index"]}
