"""The fields that constrain a reply to a grammar: OpenAI's ``response_format`` and vLLM's
``guided_regex`` and ``guided_grammar`` (a Lark grammar, as llguidance reads it).

Each becomes one ``protocol.Grammar``, checked here (compiled without a tokenizer, as the head
checks it again), so a schema that cannot be enforced is a 400 naming its field before the
request travels; the tail, two hops away, enforces it.
"""
from __future__ import annotations

from typing import Any

from fabric.client.core import grammar_of
from fabric.compute.grammar import problem
from fabric.wire.protocol import MAX_GRAMMAR, Grammar, GrammarKind

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
