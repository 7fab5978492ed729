"""The grammar of a reply that must call a function (``tool_choice`` "required" or named).

A Lark grammar as llguidance reads it: the family's markers around ``%json`` rules, each a JSON
schema ``{"name": <const>, <arguments key>: <the function's parameters>}`` (an ``anyOf`` over
the functions for "required"). So every call the tail lets through names an offered function
and its arguments validate against that function's parameters, with no key they do not declare
unless they allow others (``closed``). Separators are the ones
Python's ``json.dumps`` writes (what templates' ``tojson`` shows the model), and no other
whitespace, so a model cannot pad a call with spaces until ``max_tokens``.
"""
from __future__ import annotations

import json

from ..wire.json_schema import closed
from ..wire.protocol import Grammar, GrammarKind, ToolChoice, Tools
from .syntax import Syntax

MAX_CALLS = 16  # calls one constrained reply may hold with parallel_tool_calls (one without)
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(tools: Tools, syntax: Syntax) -> dict:
    """The JSON schema of one call the request allows."""
    options = [_one(tool["function"], syntax) for tool in tools.functions
               if tools.choice != ToolChoice.FUNCTION or tool["function"]["name"] == tools.name]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _one(function: dict, syntax: Syntax) -> dict:
    parameters = closed(function.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "object", "properties": {"name": {"const": function["name"]}, syntax.arguments: parameters},
            "required": ["name", syntax.arguments], "additionalProperties": False}


def call_grammar(tools: Tools, syntax: Syntax, marker: str = "") -> Grammar:
    """The Lark grammar of a reply of calls only. ``marker``: how the grammar writes
    ``syntax.opening`` when the tokenizer has it as one special token (``<[id]>``); "": as text."""
    calls = MAX_CALLS if tools.parallel else 1
    call = dict(call_schema(tools, syntax), **{"x-guidance": _LAYOUT})
    opening = marker or json.dumps(syntax.opening)
    if syntax.array:
        array = {"type": "array", "items": call, "minItems": 1, "maxItems": calls, "x-guidance": _LAYOUT}
        lines = [f"start: {opening} calls", f"calls: %json {json.dumps(array)}"]
    else:
        wrapped = f'{opening} "\\n" body "\\n" {json.dumps(syntax.closing)}' if syntax.opening else "body"
        more = f"({json.dumps(syntax.separator)} call){{0,{calls - 1}}}" if calls > 1 else ""
        lines = [f"start: call {more}".rstrip(), f"call: {wrapped}", f"body: %json {json.dumps(call)}"]
    return Grammar(GrammarKind.LARK, "\n".join(lines) + "\n")
