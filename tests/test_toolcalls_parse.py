"""Tool calls without a fabric: each family's syntax parsed from fixed texts, whole and as it
streams (malformed calls stay content), the syntax read off a template, the request fields
checked, the grammars compiled (tests/test_webui_tools.py: the web UI's shapes of them)."""
from __future__ import annotations

import json

import pytest

from fabric.compute.grammar import problem
from fabric.toolcalls import SYNTAXES, CallStream, Content, ToolCall, detect, parse_reply, renders_tools
from fabric.toolcalls.grammar import call_grammar
from fabric.toolcalls.request import ToolsError, tools_of
from fabric.wire.protocol import MAX_TOOLS, ToolChoice

NAMES = {"get_weather", "add"}
HERMES, LLAMA3, MISTRAL = SYNTAXES["hermes"], SYNTAXES["llama3"], SYNTAXES["mistral"]
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
A = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def calls_of(found) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in found]


# (syntax, text, content, calls)
CASES = [
    (HERMES, f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    (HERMES, f"Let me look.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{A}\n</tool_call>", "Let me look.",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    (HERMES, f"<tool_call>\n{W}", None, [("get_weather", {"city": "Paris"})]),  # ended before its closing tag
    (HERMES, f"<tool_call>\n{W}\n</tool_call", None, [("get_weather", {"city": "Paris"})]),  # max_tokens cut the tag
    (HERMES, f"<tool_call>\n{A}\n</tool_call>\n<tool_call>\n{W}\n<", None,
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris"})]),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),  # arguments written as JSON text
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
             '"parameters": {"city": "Oslo"}}', None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    (MISTRAL, f"[TOOL_CALLS][{W}, {A}]", None, [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    (MISTRAL, f"[{A}]", None, [("add", {"a": 1, "b": 2})]),  # the special marker dropped by the detokenizer
    (MISTRAL, f"Sure. [TOOL_CALLS][{A}]", "Sure.", [("add", {"a": 1, "b": 2})]),
]
# (syntax, text): looks like a call, is not one: all of it stays content
NOT_CALLS = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),  # a brace short
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call'),  # cut in its JSON
    (HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # not an offered function
    (HERMES, '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>'),  # arguments not an object
    (HERMES, "I would use <tool_call> tags here."),
    (LLAMA3, '{"city": "Paris"}'),
    (LLAMA3, '{"name": "add", "parameters": {"a": 1}} and then some'),
    (LLAMA3, 'The answer: {"name": "add", "parameters": {"a": 1}}'),  # bare JSON counts only at the start
    (MISTRAL, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}'),
    (MISTRAL, "[1, 2, 3]"),
    (HERMES, "plain text, nothing else"),
]


@pytest.mark.parametrize("syntax, text, content, calls", CASES)
def test_each_family_syntax_parses(syntax, text, content, calls):
    found_content, found = parse_reply(text, syntax, NAMES)
    assert (found_content, calls_of(found)) == (content, calls)
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in found) and len({c.id for c in found}) == len(found)


@pytest.mark.parametrize("syntax, text", NOT_CALLS)
def test_what_does_not_parse_stays_content(syntax, text):
    assert parse_reply(text, syntax, NAMES) == (text, [])


@pytest.mark.parametrize("syntax, text, content, calls", CASES + [(s, t, t, []) for s, t in NOT_CALLS])
def test_a_stream_in_pieces_gives_what_the_whole_text_gives(syntax, text, content, calls):
    for size in (1, 3, 7):
        stream = CallStream(syntax, NAMES)
        pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i:i + size])] + stream.finish()
        streamed = "".join(p.text for p in pieces if isinstance(p, Content))
        assert streamed == (content or "") and calls_of(p for p in pieces if isinstance(p, ToolCall)) == calls


def test_text_before_a_call_streams_before_the_call_closes():
    stream = CallStream(HERMES, NAMES)
    assert stream.feed("Checking the weather <tool") == [Content("Checking the weather")]
    assert stream.feed("_call>\n" + W[:20]) == []  # held: it may be a call
    assert calls_of(stream.feed(W[20:] + "\n</tool_call>")) == [("get_weather", {"city": "Paris"})]
    assert stream.feed("\n") == [] and stream.finish() == []  # whitespace after a call is no content


def test_the_syntax_is_read_off_the_template():
    assert detect("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect("{{ '[TOOL_CALLS]' }} {{ tools }}") is MISTRAL
    assert detect("<|start_header_id|>ipython<|end_header_id|>{{ tools }}") is LLAMA3
    assert detect("{{ tools }} something new") is HERMES  # the default
    assert renders_tools("{% for t in tools %}{% endfor %}") and renders_tools({"tool_use": "{{ tools }}"})
    assert not renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}") and not renders_tools(None)


TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.mark.parametrize("tools, choice, parallel, field", [
    ("add", None, None, "tools"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, None, "tools"),
    ([{"type": "retrieval"}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "an object"}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, None, "tools"),
    ([TOOL, TOOL], None, None, "tools"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "description": "x" * (64 << 10)}}], None, None, "tools"),
    ([TOOL], "sometimes", None, "tool_choice"),
    ([TOOL], {"type": "function", "function": {"name": "sub"}}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    ([TOOL], "auto", "yes", "parallel_tool_calls"),
])
def test_bad_tool_fields_are_named(tools, choice, parallel, field):
    with pytest.raises(ToolsError) as refused:
        tools_of(tools, choice, parallel)
    assert refused.value.field == field, str(refused.value)


def test_tool_fields_that_ask_for_nothing_give_none():
    assert tools_of(None, "none") is None and tools_of([], "auto") is None
    named = tools_of([TOOL], {"type": "function", "function": {"name": "add"}}, False)
    assert (named.choice, named.name, named.parallel) == (ToolChoice.FUNCTION, "add", False)


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_call_grammars_compile(syntax, choice, parallel):
    other = {"type": "function", "function": {"name": "get_weather"}}
    grammar = call_grammar(tools_of([TOOL, other], choice, parallel), SYNTAXES[syntax])
    assert problem(grammar) == ""
    assert '"const": "add"' in grammar.source and ('"get_weather"' in grammar.source) == (choice == "required")


def test_a_marker_the_tokenizer_holds_as_a_special_token_is_asked_for_as_that_token(tiny_models):
    """Mistral's [TOOL_CALLS] is one special token: the grammar names it by id (llguidance's
    ``<[id]>``), since its text spelled out in ordinary tokens is not what the model writes."""
    from transformers import AutoTokenizer

    from fabric.node.tool_use import constrained
    from fabric.wire.protocol import Generate, Hop

    tokenizer = AutoTokenizer.from_pretrained(tiny_models("llama"))
    req = Generate("r", (Hop("h", "tcp://127.0.0.1:1", 0, 5),), messages=({"role": "user", "content": "x"},),
                   tools=tools_of([TOOL], "required"))
    assert constrained(tokenizer, req, MISTRAL).grammar.source.startswith('start: "[TOOL_CALLS]" calls')
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    token_id = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    grammar = constrained(tokenizer, req, MISTRAL).grammar
    assert grammar.source.startswith(f"start: <[{token_id}]> calls") and problem(grammar) == ""
    assert constrained(tokenizer, req, HERMES).grammar.source.splitlines()[1] == \
        'call: "<tool_call>" "\\n" body "\\n" "</tool_call>"'
