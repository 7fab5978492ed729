"""The web UI's OpenAI shapes of tool calls, over a fake fabric whose reply is a Hermes call,
read by the official SDK (httpx's ASGI transport, no server process): ``message.tool_calls``,
the ``delta.tool_calls`` chunks, finish_reason "tool_calls", and the tool fields' 400s."""
from __future__ import annotations

import json

import pytest

from webui import WebUIConfig, create_app
from webui.testing import FakeClient, Script

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP library this openai release is built on

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


HERMES_REPLY = ("Sure.", " <tool_", "call>\n", '{"name": "add", ', '"arguments": {"a": 1}}', "\n</tool_call>")


@pytest.fixture
def fake():
    return FakeClient(script=Script(tokens=HERMES_REPLY))


@pytest.fixture
def sdk(fake):
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
