"""A grammar as llguidance's text, and its check: no tokenizer, no torch.

``to_llguidance`` turns a ``protocol.Grammar`` (a JSON schema, any JSON object, a regex or a
Lark grammar) into llguidance's grammar text; ``problem`` is what the head and the web UI
check before a grammar travels. An object schema that lists its properties and says nothing of
others allows no others (``fabric.wire.json_schema.closed``), as llama.cpp's server and vLLM's
default engine read it. The web UI imports this, not fabric/compute/grammar.py, whose masks need
torch: a web UI process never loads it.
"""
from __future__ import annotations

import hashlib
import json

import llguidance

from ..wire.json_schema import closed
from ..wire.protocol import Grammar, GrammarKind

# JSON without optional whitespace: a free model could otherwise pad a reply with spaces to max_tokens
_COMPACT = {"whitespace_flexible": False}


class GrammarError(Exception):
    """A grammar that does not compile, or tokens it does not allow (a re-prefill's history)."""


def to_llguidance(grammar: Grammar) -> str:
    """llguidance's grammar text for ``grammar``; GrammarError when its source does not parse."""
    match grammar.kind:
        case GrammarKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT)
        case GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(grammar.source)
            except RecursionError:
                raise GrammarError("the schema nests too deeply") from None
            except ValueError as exc:
                raise GrammarError(f"the schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema is an object (or true/false)")
            return llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults=_COMPACT)
        case GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(grammar.source)
        case GrammarKind.LARK:
            return llguidance.LLMatcher.grammar_from_lark(grammar.source)
    raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


def problem(grammar: Grammar) -> str:
    """What is wrong with ``grammar`` ("" when nothing): checked without a tokenizer, so a bad
    schema is refused where the request comes in, not two hops away."""
    try:
        return llguidance.LLMatcher.validate_grammar(to_llguidance(grammar))
    except (GrammarError, ValueError, TypeError) as exc:
        return str(exc)


def digest(grammar: Grammar) -> str:
    """What identifies a compiled grammar: its kind and source, not the tokens generated."""
    return hashlib.sha256(f"{grammar.kind}\0{grammar.source}".encode()).hexdigest()
