"""A grammar as llguidance's text, and its check: no tokenizer, no torch.

``to_llguidance`` turns a ``protocol.Grammar`` (a JSON schema, any JSON object, a regex or a
Lark grammar) into llguidance's grammar text; ``problem`` is what the head and the web UI
check before a grammar travels. An object schema that lists its properties and says nothing of
others allows no others (``closed``), as llama.cpp's server and vLLM's default engine read it.
The web UI imports this, not fabric/compute/grammar.py, whose masks need torch: a web UI
process never loads it.
"""
from __future__ import annotations

import hashlib
import json

import llguidance

from ..wire.protocol import Grammar, GrammarKind

# JSON without optional whitespace: a free model could otherwise pad a reply with spaces to max_tokens
_COMPACT = {"whitespace_flexible": False}


# where a schema holds schemas that a value must match as they stand: one, several, or a map of them
_ONE = ("additionalProperties", "items", "additionalItems")
_SEVERAL = ("anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
# keys that intersect schemas: a branch closed to its own properties would refuse the others'
_INTERSECTING = ("allOf", "if", "then", "else", "not", "dependentSchemas", "dependencies")
MAX_SCHEMA_DEPTH = 128  # llguidance refuses a schema whose JSON nests deeper than about this


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


def closed(schema, depth: int = 0):
    """``schema`` with ``"additionalProperties": false`` on each object schema that lists
    ``properties`` (or ``patternProperties``) and says nothing of others. JSON Schema would allow
    any other key there, and a model given the room fills it: a function's arguments would come
    with keys nobody declared. ``true`` (or a schema) keeps them allowed. Only places that hold
    schemas a value must match are walked (never a ``const``, ``enum`` or ``default`` value), and
    a schema that intersects schemas anywhere (``allOf``, ``if``, ``not``, a ``$ref`` beside
    properties) is left as written, since closing one side would refuse the other's keys. Nothing
    deeper than MAX_SCHEMA_DEPTH is touched (llguidance refuses it anyway). A copy."""
    if depth == 0 and _intersects(schema):
        return schema
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key], depth + 1)
    for key in _SEVERAL:
        if isinstance(out.get(key), list):
            out[key] = [closed(s, depth + 1) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s, depth + 1) for name, s in out[key].items()}
    lists = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if lists and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _intersects(schema) -> bool:
    """Whether any map in ``schema`` (values too: this errs toward leaving a schema as written)
    intersects schemas. Walked without recursion, as deep as it goes."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if any(key in item for key in _INTERSECTING) or ("$ref" in item and "properties" in item):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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
