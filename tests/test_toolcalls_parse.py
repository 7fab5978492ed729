"""Tool calls without a fabric: each family's syntax parsed from fixed texts, whole and as it
streams (malformed calls stay content), the syntax read off a template, the request fields
checked, the grammars compiled; and the web UI's OpenAI shapes over a fake fabric whose
reply is a call, read by the official SDK."""
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


# --------------------------------------------------------------------------- the web UI's shapes

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

HERMES_REPLY = ("Sure.", " <tool_", "call>\n", '{"name": "add", ', '"arguments": {"a": 1}}', "\n</tool_call>")


@pytest.fixture
def fake():
    from webui.testing import FakeClient, Script

    return FakeClient(script=Script(tokens=HERMES_REPLY))


@pytest.fixture
def sdk(fake):
    from webui import WebUIConfig, create_app

    app = create_app(WebUIConfig(pub=None), fake)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webui")
    return openai.AsyncOpenAI(base_url="http://webui/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.mark.asyncio
async def test_the_web_ui_gives_openai_tool_calls_whole_and_streamed(sdk, fake):
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "add"}], tools=[TOOL], logprobs=True)
    whole = (await sdk.chat.completions.create(**kw)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    (call,) = whole.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "add", {"a": 1})
    assert len(whole.logprobs.content) == len(HERMES_REPLY)
    chunks = [c async for c in await sdk.chat.completions.create(**kw, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    opening, arguments = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert (opening.index, opening.function.name, opening.function.arguments) == (0, "add", "")
    assert opening.id.startswith("call_") and arguments.id is None and arguments.function.arguments == '{"a": 1}'
    assert "".join(d.content or "" for d in deltas) == "Sure."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed_logprobs = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed_logprobs) == len(HERMES_REPLY)
    assert fake.calls[-1].tools.functions == (TOOL,)


@pytest.mark.asyncio
async def test_tool_choice_none_and_no_tools_leave_the_text_alone(sdk):
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "add"}])
    for extra in ({}, {"tools": [TOOL], "tool_choice": "none"}):
        choice = (await sdk.chat.completions.create(**kw, **extra)).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == "".join(HERMES_REPLY)
        assert not choice.message.tool_calls


@pytest.mark.asyncio
async def test_tool_fields_are_checked_before_the_fabric(sdk, fake):
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "add"}])
    for extra, param in (({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
                         ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
                         ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
                          "tool_choice"),
                         ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls")):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(**kw, extra_body=extra)
        assert refused.value.body["param"] == param, refused.value.body
    assert not fake.calls
