"""The fields that constrain a reply to a grammar: OpenAI's ``response_format`` and vLLM's
``guided_regex`` and ``guided_grammar`` (a Lark grammar, as llguidance reads it); and the tool
fields, whose "required" or named ``tool_choice`` is a grammar the head builds (it knows the
template's call syntax), so it excludes the other three.

Each becomes one ``protocol.Grammar``, checked here (compiled without a tokenizer, as the head
checks it again), so a schema that cannot be enforced is a 400 naming its field before the
request travels; the tail, two hops away, enforces it.
"""
from __future__ import annotations

from typing import Any

from fabric.client.core import grammar_of
from fabric.compute.grammar_text import problem
from fabric.toolcalls.request import ToolsError, tools_of
from fabric.wire.protocol import MAX_GRAMMAR, Grammar, GrammarKind, Tools

from .errors import ApiError

GUIDED = {"guided_regex": GrammarKind.REGEX, "guided_grammar": GrammarKind.LARK}


def grammar(body: dict[str, Any]) -> Grammar | None:
    """The grammar ``body`` asks for (at most one of the three fields); None: free text."""
    asked = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    if len(asked) > 1:
        raise ApiError.invalid(f"{asked[1]}: give one of response_format, guided_regex or guided_grammar",
                               asked[1])
    if not asked:
        return None
    name = asked[0]
    try:
        found = grammar_of(body[name]) if name == "response_format" else _guided(name, body[name])
    except ValueError as exc:
        raise ApiError.invalid(f"{name}: {exc}", name) from None
    if found is not None and (wrong := problem(found)):
        raise ApiError.invalid(f"{name}: {wrong}"[:1000], name)
    return found


def _guided(name: str, value: Any) -> Grammar:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    if len(value) > MAX_GRAMMAR:
        raise ValueError(f"at most {MAX_GRAMMAR} characters")
    return Grammar(GUIDED[name], value)


def tool_fields(body: dict[str, Any], grammar_asked: Grammar | None) -> Tools | None:
    """The functions ``body`` offers (``tools``, ``tool_choice``, ``parallel_tool_calls``)."""
    try:
        found = tools_of(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ToolsError as exc:
        raise ApiError.invalid(str(exc)[:1000], exc.field) from None
    if found is not None and grammar_asked is not None and found.requires_call:
        raise ApiError.invalid("tool_choice: a required or named call is constrained by a grammar of its own; "
                               "drop response_format (or guided_regex, guided_grammar)", "tool_choice")
    return found
