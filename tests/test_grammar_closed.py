"""An object schema that lists its properties allows no key it does not list, unless it says so:
in ``response_format`` and in the arguments of a required tool call. llama.cpp's server and
vLLM's default engine read a schema so; JSON Schema itself would allow any other key, and a
model given the room writes them (a function called with arguments nobody declared). Checked
with the tail's own matcher and a tiny model's tokenizer, key by key; no fabric."""
from __future__ import annotations

import json

import pytest

from fabric.compute.grammar import GrammarError, Grammars, problem
from fabric.wire.json_schema import MAX_SCHEMA_DEPTH, closed
from fabric.toolcalls import SYNTAXES
from fabric.toolcalls.grammar import call_grammar
from fabric.toolcalls.request import tools_of
from fabric.wire.protocol import Grammar, GrammarKind

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}


@pytest.fixture(scope="module")
def allows(tiny_models):
    """(grammar, text) -> whether the tail's matcher takes the whole text and is then complete."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models("llama"))
    grammars = Grammars(lambda: tokenizer, len(tokenizer), lambda t: [t.eos_token_id])

    def check(grammar: Grammar, text: str) -> bool:
        matcher = grammars.matcher(grammar)
        try:
            matcher.advance_all(tokenizer.encode(text, add_special_tokens=False))
        except GrammarError:
            return False
        return bool(matcher.allowed()[tokenizer.eos_token_id])
    return check


def schema(value) -> Grammar:
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(value))


def test_a_schema_that_lists_its_properties_takes_them_and_no_other_key(allows):
    assert allows(schema(CITY), '{"city":"Oslo"}') and allows(schema(CITY), '{"city":"Oslo","days":3}')
    assert not allows(schema(CITY), '{"city":"Oslo","zz":1}')
    assert not allows(schema(CITY), '{"city":"Oslo","days":3,"days2":4}')
    nested = {"type": "object", "properties": {"at": CITY}, "required": ["at"]}
    assert allows(schema(nested), '{"at":{"city":"Oslo"}}')
    assert not allows(schema(nested), '{"at":{"city":"Oslo","zz":1}}')
    assert not allows(schema(nested), '{"at":{"city":"Oslo"},"zz":1}')


def test_a_schema_that_allows_other_keys_keeps_them(allows):
    assert allows(schema({**CITY, "additionalProperties": True}), '{"city":"Oslo","zz":1}')
    assert allows(schema({**CITY, "additionalProperties": {"type": "integer"}}), '{"city":"Oslo","zz":1}')
    assert not allows(schema({**CITY, "additionalProperties": {"type": "integer"}}), '{"city":"Oslo","zz":"a"}')
    assert allows(Grammar(GrammarKind.JSON_OBJECT, ""), '{"zz":1}')  # any JSON object, as before


@pytest.mark.parametrize("syntax", ["hermes", "mistral", "llama3"])
def test_a_required_call_s_arguments_take_no_key_its_function_does_not_declare(allows, syntax):
    function = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
    grammar = call_grammar(tools_of([function], "required", False), SYNTAXES[syntax])
    key = SYNTAXES[syntax].arguments
    call = {"hermes": '<tool_call>\n{}\n</tool_call>', "mistral": "[TOOL_CALLS][{}]", "llama3": "{}"}[syntax]
    good = json.dumps({"name": "weather", key: {"city": "Oslo"}})
    bad = json.dumps({"name": "weather", key: {"city": "Oslo", "zz": 1}})
    assert allows(grammar, call.format(good))
    assert not allows(grammar, call.format(bad))


def test_only_schemas_are_closed_never_values():
    inner = {"type": "object", "properties": {"a": {"type": "string"}}}
    source = {"type": "object", "properties": {
        "properties": {"type": "string"},  # a property of that name: its schema, not a schema's map
        "fixed": {"const": {"properties": {}}, "default": {"properties": 1}, "enum": [{"properties": 2}]},
        "list": {"type": "array", "items": inner, "prefixItems": [inner]},
        "either": {"anyOf": [inner, {"type": "null"}]},
        "open": {**inner, "additionalProperties": {"type": "integer"}},
        "ref": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": inner}}
    before = json.dumps(source)
    out = closed(source)
    assert json.dumps(source) == before  # the input is unchanged
    shut = {**inner, "additionalProperties": False}
    assert out["additionalProperties"] is False and out["$defs"]["thing"] == shut
    props = out["properties"]
    assert props["properties"] == {"type": "string"} and "additionalProperties" not in props
    assert props["fixed"] == source["properties"]["fixed"]
    assert props["list"]["items"] == shut and props["list"]["prefixItems"] == [shut]
    assert props["either"]["anyOf"] == [shut, {"type": "null"}]
    assert props["open"] == source["properties"]["open"] and props["ref"] == {"$ref": "#/$defs/thing"}
    assert closed({"type": "object"}) == {"type": "object"} and closed(True) is True


@pytest.mark.parametrize("combined", [
    {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"$ref": "#/$defs/base", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
    {"properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}, "then": {"properties": {"b": {}}}},
])
def test_a_schema_that_intersects_schemas_is_left_as_written(allows, combined):
    """Closing one side of an intersection would refuse the other side's keys: a base and its
    extension (OpenAPI's inheritance) would have no valid object left."""
    document = {**combined, "$defs": {"base": {"type": "object", "properties": {"a": {"type": "string"}},
                                               "required": ["a"]}}}
    assert closed(document) == document
    if "if" not in document:
        assert allows(schema(document), '{"a":"x","b":1}')


def test_a_schema_nested_too_deeply_is_a_clear_problem_not_a_crash():
    deep = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 50):
        deep = {"type": "object", "properties": {"a": deep}}
    assert closed(deep)["additionalProperties"] is False  # what lies past the depth is left as it is
    assert problem(schema(deep))  # llguidance refuses that depth
    text = '{"type":"object","properties":{"a":' * 5000 + "{}" + "}}" * 5000
    assert "nests too deeply" in problem(Grammar(GrammarKind.JSON_SCHEMA, text))
