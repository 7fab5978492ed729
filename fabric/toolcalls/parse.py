"""A reply's text back into OpenAI's ``tool_calls``, as it streams or whole.

``CallStream`` is fed the reply's text as it comes and gives back pieces: ``Content`` (text
for the user) and ``ToolCall``s. Text before a call's opening marker streams at once (less a
tail that could still begin the marker); from the marker on it is held until the call closes
(hermes: ``</tool_call>``) or the reply ends (mistral's array, llama3's bare JSON, which only
counts at the very start of a reply). A held block that does not parse as calls of offered
functions goes out as content, unchanged: text that only looks like a call stays text.
Trailing whitespace is held until other content follows and dropped before a call, so a
reply of calls has no content, and streamed text reads as the whole text parsed at once.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from .syntax import LLAMA3, Syntax

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a JSON call with it


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = Content | ToolCall


class CallStream:
    """One reply's parser: ``feed`` each piece of text, then ``finish``."""

    def __init__(self, syntax: Syntax, names: frozenset[str] | set[str]):
        self.syntax = syntax
        self.names = frozenset(names)
        self._buf = ""  # text not yet given back
        self._inside = False  # _buf starts with a call's opening (or a bare call)
        self._started = False  # the reply had text other than whitespace
        self._blank = ""  # whitespace held until other content follows
        self.calls = 0  # calls given back so far

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._tidy(self._drain())

    def finish(self) -> list[Piece]:
        out = self._drain()
        if self._buf:
            out += self._block(self._buf) if self._inside else [Content(self._buf)]
        self._buf, self._inside = "", False
        out = self._tidy(out)
        if self._blank and not self.calls:
            out.append(Content(self._blank))
        self._blank = ""
        return out

    def _drain(self) -> list[Piece]:
        out: list[Piece] = []
        while self._buf:
            if self._inside:
                end = self._buf.find(self.syntax.closing) if self.syntax.closing else -1
                if end < 0:
                    break  # wait for the closing marker, or the reply's end
                end += len(self.syntax.closing)
                out += self._block(self._buf[:end])
                self._buf, self._inside = self._buf[end:], False
            elif not self._started and self._bare_start():
                if not self._buf.strip():
                    break
                self._started = self._inside = True
            else:
                out += self._until_opening()
                if not self._inside:
                    break
        return out

    def _bare_start(self) -> bool:
        """Whether the reply so far could still be a bare call (llama3's JSON, or mistral's array
        after a detokenizer dropped its special marker)."""
        text = self._buf.lstrip()
        if self.syntax is LLAMA3:
            return not text or text[0] == "{" or PYTHON_TAG.startswith(text[:len(PYTHON_TAG)])
        return self.syntax.array and (not text or text[0] == "[")

    def _until_opening(self) -> list[Piece]:
        """Content up to the opening marker (then ``_inside``), or up to a tail that could begin it."""
        self._started = self._started or bool(self._buf.strip())
        opening = self.syntax.opening
        at = self._buf.find(opening) if opening else -1
        if at >= 0:
            out, self._buf, self._inside = self._buf[:at], self._buf[at:], True
            return [Content(out)] if out else []
        keep = next((n for n in range(min(len(opening) - 1, len(self._buf)), 0, -1)
                     if opening.startswith(self._buf[-n:])), 0) if opening else 0
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return [Content(out)] if out else []

    def _block(self, text: str) -> list[Piece]:
        """The calls ``text`` holds (a held block), or ``text`` as content when it does not parse."""
        try:
            calls, rest = _calls(text, self.syntax, self.names)
        except ValueError:
            return [Content(text)]
        self.calls += len(calls)
        return [*calls, *([Content(rest)] if rest else [])]

    def _tidy(self, pieces: list[Piece]) -> list[Piece]:
        """Merge neighbouring content; hold trailing whitespace until other content follows (a
        call drops it), so text streamed in pieces reads as the whole text parsed at once."""
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                self._blank = ""
                out.append(piece)
                continue
            text = self._blank + piece.text
            kept = text.rstrip()
            self._blank = text[len(kept):]
            if kept:
                if out and isinstance(out[-1], Content):
                    kept = out.pop().text + kept
                out.append(Content(kept))
        return out


def parse_reply(text: str, syntax: Syntax, names) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; content None when the reply was only calls."""
    stream = CallStream(syntax, names)
    pieces = stream.feed(text) + stream.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    return (None if calls and not content.strip() else content), calls


# --------------------------------------------------------------------------- one block


def _calls(text: str, syntax: Syntax, names: frozenset[str]) -> tuple[list[ToolCall], str]:
    """(calls, text after them) of a held block; ValueError when it is not calls."""
    if syntax.closing:  # hermes: exactly one call between the markers
        return [_call(json.loads(_unclosed(text[len(syntax.opening):], syntax.closing)), syntax, names)], ""
    body = text.strip().removeprefix(syntax.opening).removeprefix(PYTHON_TAG).lstrip()
    decoder = json.JSONDecoder()
    if syntax.array:
        found, end = decoder.raw_decode(body)
        if not isinstance(found, list) or not found:
            raise ValueError("not a list of calls")
        return [_call(c, syntax, names) for c in found], body[end:].strip()
    calls, at = [], 0
    while True:  # llama3: objects separated by ";" to the end
        found, at = decoder.raw_decode(body, at)
        calls.append(_call(found, syntax, names))
        rest = body[at:].lstrip()
        if not rest:
            return calls, ""
        if not rest.startswith(";"):
            raise ValueError("text after a call")
        at = len(body) - len(rest[1:].lstrip())


def _unclosed(body: str, closing: str) -> str:
    """``body`` less its closing marker: the whole marker, or as much of it as a reply cut short
    (``max_tokens``) got to write, so that a call whose JSON was complete is still a call."""
    end = body.rstrip()
    cut = next((n for n in range(len(closing), 0, -1) if end.endswith(closing[:n])), 0)
    return end[:len(end) - cut] if cut else body


def _call(found: object, syntax: Syntax, names: frozenset[str]) -> ToolCall:
    if not isinstance(found, dict) or found.get("name") not in names:
        raise ValueError("not a call of an offered function")
    arguments = found.get(syntax.arguments, found.get("arguments", found.get("parameters")))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict) or set(found) - {"name", "arguments", "parameters"}:
        raise ValueError("a call's arguments are one JSON object")
    return ToolCall(found["name"], json.dumps(arguments, ensure_ascii=False))
