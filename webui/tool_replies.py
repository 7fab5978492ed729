"""A chat reply's tool calls in OpenAI's shapes: ``message.tool_calls`` of a whole reply, and
the ``delta.tool_calls`` chunks of a streamed one (index, id, type and name first, then the
arguments), as the official SDKs accumulate them.

The head names the call syntax in its start event (its chat template decides it); the text
is parsed by ``fabric.toolcalls``: ordinary text streams as it comes, a call goes out when it
closes, and text that only looks like a call stays content.
"""
from __future__ import annotations

from fabric.toolcalls import SYNTAXES, CallStream, Content, ToolCall, parse_reply

TOOL_CALLS = "tool_calls"  # finish_reason of a reply that called functions


class ToolReplies:
    """One chat reply's calls, among the functions ``names`` offered."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self._stream: CallStream | None = None  # set by the start event when the head names a syntax

    def start(self, syntax: str) -> None:
        if syntax in SYNTAXES:
            self._stream = CallStream(SYNTAXES[syntax], self.names)

    @property
    def parsing(self) -> bool:
        return self._stream is not None

    def feed(self, text: str) -> list[Content | ToolCall]:
        return self._stream.feed(text) if self._stream else [Content(text)]

    def finish(self) -> list[Content | ToolCall]:
        return self._stream.finish() if self._stream else []

    @property
    def called(self) -> int:
        return self._stream.calls if self._stream else 0

    def whole(self, text: str, syntax: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool_calls) of a whole reply the head wrote in ``syntax``."""
        if syntax not in SYNTAXES:
            return text, []
        content, calls = parse_reply(text, SYNTAXES[syntax], self.names)
        return content, [c.openai() for c in calls]


def call_deltas(index: int, call: ToolCall) -> list[dict]:
    """The two ``delta`` objects of call ``index``: who is called, then the arguments."""
    opening = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{TOOL_CALLS: [opening]}, {TOOL_CALLS: [{"index": index, "function": {"arguments": call.arguments}}]}]


def finish_reason(reason: str, called: int) -> str:
    """``tool_calls`` when the reply called functions and ended by itself."""
    return TOOL_CALLS if called and reason == "stop" else reason
