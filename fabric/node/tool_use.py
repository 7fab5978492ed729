"""The head's side of tool calls: render the offered functions through the chat template,
pick the family's call syntax from the template, and constrain the reply with a grammar when
the request requires a call.

A template that does not read ``tools`` would drop them without a word, so such a request is
refused naming ``tools``. History in OpenAI's shape (an assistant's ``tool_calls`` with
``arguments`` as JSON text, ``tool`` messages) is handed to the template in the shape templates
read (``arguments`` an object), as vLLM does.
"""
from __future__ import annotations

import dataclasses
import json

from ..toolcalls.grammar import call_grammar
from ..toolcalls.syntax import Syntax, detect, renders_tools
from ..wire.protocol import ErrorCode, Generate, ToolChoice


class ToolRefusal(Exception):
    """A tool request this head cannot serve (its message names the field)."""

    code = ErrorCode.BAD_REQUEST


def template_source(tokenizer) -> str:
    """The template transformers renders a chat with tools by (a dict of named templates
    offers "tool_use", else "default")."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def syntax_of(tokenizer, req: Generate) -> Syntax | None:
    """The call syntax of ``req``'s reply, or None when it offers no tools; ToolRefusal when
    this model's template cannot show them."""
    if req.tools is None:
        return None
    source = template_source(tokenizer)
    if not renders_tools(source):
        raise ToolRefusal("tools: this model's chat template does not render tools, so the model would never "
                          "see them; send the request without tools")
    return detect(source)


def tool_syntax(req: Generate, syntax: Syntax | None) -> str:
    """What the start event tells the client to parse the reply by: "" with no tools, or
    ``tool_choice`` "none" (the reply is text, whatever it looks like)."""
    return syntax.name if syntax is not None and req.tools.choice != ToolChoice.NONE else ""


def constrained(tokenizer, req: Generate, syntax: Syntax | None) -> Generate:
    """``req`` with the grammar of a reply of calls when ``tool_choice`` requires one."""
    if syntax is None or req.tools.choice not in (ToolChoice.REQUIRED, ToolChoice.FUNCTION):
        return req
    return dataclasses.replace(req, grammar=call_grammar(req.tools, syntax, _special(tokenizer, syntax.opening)))


def _special(tokenizer, text: str) -> str:
    """``text`` as llguidance names a special token (``<[id]>``) when the tokenizer has it as
    one, so the grammar asks for that token; "" when it is ordinary text."""
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if text and added.content == text and added.special:
            return f"<[{token_id}]>"
    return ""


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages in the shape chat templates read: a call's ``arguments`` an object
    (JSON text that is no object stays as it is), null content an empty string."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [_readable(call) for call in m["tool_calls"]]
        out.append(m)
    return out


def _readable(call: dict) -> dict:
    function = dict(call["function"])
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = None
    if isinstance(arguments, dict):
        function["arguments"] = arguments
    return {**call, "function": function}
