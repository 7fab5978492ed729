"""The conversations a Responses API client may continue by ``previous_response_id``.

OpenAI keeps each response (``store``, true by default) so that the next request can name it
instead of sending the conversation again: its documentation's multi-turn example does so. This
web UI keeps, in memory, the last MAX_KEPT conversations, each as the chat messages that led to
its response and the response's own turn, under its API key's id and its response id, so one
key never continues another's. A restart forgets them (a named response then is a 400).
``instructions`` are not kept: each request's apply to it alone, as with OpenAI.
"""
from __future__ import annotations

from collections import OrderedDict

from .responses import chat_call

MAX_KEPT = 256  # conversations kept; the least recently used goes first


class ResponseStore:
    def __init__(self, max_kept: int = MAX_KEPT):
        self.max_kept = max_kept
        self._kept: OrderedDict[tuple[str, str], tuple[dict, ...]] = OrderedDict()

    def get(self, tenant: str, response_id: str) -> list[dict] | None:
        """The conversation up to and with response ``response_id`` of ``tenant`` (None: not kept)."""
        found = self._kept.get((tenant, response_id))
        if found is None:
            return None
        self._kept.move_to_end((tenant, response_id))
        return [dict(m) for m in found]

    def put(self, tenant: str, response_id: str, messages: list[dict], output: list[dict]) -> None:
        """Keep ``messages`` (what the request asked, without its instructions) and the turn of
        ``output``, the response's output items."""
        self._kept[(tenant, response_id)] = tuple(messages) + tuple(reply_messages(output))
        self._kept.move_to_end((tenant, response_id))
        while len(self._kept) > self.max_kept:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)


def reply_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the assistant's chat turn: its text, and its calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [chat_call(item["call_id"], item["name"], item["arguments"])
             for item in output if item["type"] == "function_call"]
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]
