"""No request field is silently ignored: each is honoured, harmless, or refused with a 400 naming it.

The official openai SDK, unmodified, sends its requests to the web UI app in this process
(httpx's ASGI transport: the SDK's own serialization of every field, no server process).
"""
from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest

from fabric.wire.protocol import Grammar
from webui import WebUIConfig, create_app
from webui.fields import CHAT, COMPLETIONS, FIELDS
from webui.testing import FakeClient

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP library this openai release is built on

MODEL = "smollm2-135m"  # the fake fabric's model
MESSAGES = [{"role": "user", "content": "hi"}]
README = Path(__file__).resolve().parent.parent / "README.md"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

# field -> a value that asks for something this server does not do (chat)
REFUSED_CHAT = {
    "functions": [TOOL["function"]], "function_call": "auto",
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "service_tier": "flex", "metadata": "not an object", "store": "yes",
}
REFUSED_COMPLETIONS = {"echo": True, "best_of": 2, "suffix": "the end", "user": 5}
# field -> a value out of its range (honoured fields check their values)
OUT_OF_RANGE = {"presence_penalty": 2.5, "frequency_penalty": -3, "logit_bias": {"5": 101}}
ACCEPTED_CHAT = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "safety_identifier": "s", "n": 1,
                 "prompt_cache_key": "k", "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
                 "response_format": {"type": "text"}, "tool_choice": "none", "service_tier": "auto",
                 "modalities": ["text"]}
ACCEPTED_COMPLETIONS = {"user": "u-1", "echo": False, "best_of": 1, "suffix": "", "n": 1, "logit_bias": {}}


@pytest.fixture
def fake():
    """The fabric client the web UI calls: it records each call."""
    return FakeClient()


@pytest.fixture
def sdk(fake):
    app = create_app(WebUIConfig(pub=None), fake)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webui")
    return openai.AsyncOpenAI(base_url="http://webui/v1", api_key="unused", http_client=http, max_retries=0)


async def _refused(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await call
    error = refused.value.body
    assert refused.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split(".")[-1] in error["message"], error


@pytest.mark.asyncio
@pytest.mark.parametrize("field", sorted(REFUSED_CHAT))
async def test_chat_refuses_each_field_it_does_not_implement(sdk, field):
    call = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **{field: REFUSED_CHAT[field]})
    await _refused(call, field)


@pytest.mark.asyncio
@pytest.mark.parametrize("field", sorted(REFUSED_COMPLETIONS))
async def test_completions_refuse_each_field_they_do_not_implement(sdk, field):
    call = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4, **{field: REFUSED_COMPLETIONS[field]})
    await _refused(call, field)


@pytest.mark.asyncio
@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
async def test_penalties_and_bias_out_of_range_are_refused(sdk, field):
    await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: OUT_OF_RANGE[field]}), field)
    await _refused(sdk.completions.create(model=MODEL, prompt="hi", **{field: OUT_OF_RANGE[field]}), field)


@pytest.mark.asyncio
async def test_logit_bias_keys_must_be_token_ids(sdk):
    for bias in ({"the": 1}, {"-1": 1}, {"7": 1, "07": 2}, {str(i): 1 for i in range(301)}, {"5": "high"}):
        await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias=bias), "logit_bias")


@pytest.mark.asyncio
async def test_penalties_and_bias_reach_the_fabric(sdk, fake):
    await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, presence_penalty=0.5, frequency_penalty=-1,
                                      logit_bias={"5": -100, "17": 3.5})
    call = fake.calls[-1]
    assert (call.presence_penalty, call.frequency_penalty, call.logit_bias) == (0.5, -1.0, {5: -100.0, 17: 3.5})


@pytest.mark.asyncio
async def test_response_format_reaches_the_fabric_as_a_grammar(sdk, fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert fake.calls[-1].response_format == Grammar("json_schema", json.dumps(schema, separators=(",", ":")))
    await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    assert fake.calls[-1].response_format == Grammar("json_object")
    await sdk.completions.create(model=MODEL, prompt="hi", extra_body={"guided_regex": "[0-9]+"})
    assert fake.calls[-1].response_format == Grammar("regex", "[0-9]+")
    await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"})
    assert fake.calls[-1].response_format is None


@pytest.mark.asyncio
@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "x" * (64 << 10)}}}}, "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
async def test_a_grammar_that_cannot_be_enforced_is_refused(sdk, fields, param):
    await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=fields), param)


@pytest.mark.asyncio
async def test_n_above_one_and_unknown_fields_are_refused(sdk):
    await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, n=2), "n")
    await _refused(sdk.completions.create(model=MODEL, prompt="hi", n=2), "n")
    for extension in ("min_p", "guided_json", "repetition_penalty"):  # vLLM's, not ours: refused, not dropped
        await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={extension: 1}),
                       extension)
    await _refused(sdk.completions.create(model=MODEL, prompt="hi", extra_body={"messages": MESSAGES}), "messages")
    await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"prompt": "x"}), "prompt")
    await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=False, top_logprobs=2),
                   "top_logprobs")
    await _refused(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=21),
                   "top_logprobs")
    await _refused(sdk.completions.create(model=MODEL, prompt="hi", logprobs=21), "logprobs")


@pytest.mark.asyncio
async def test_message_keys_beyond_openais_are_refused(sdk):
    history = [*MESSAGES, {"role": "assistant", "content": "x", "refusal": "no"}]
    await _refused(sdk.chat.completions.create(model=MODEL, messages=history), "messages[1].refusal")
    named = [{"role": "user", "content": "hi", "name": "ann"}]
    assert (await sdk.chat.completions.create(model=MODEL, messages=named, max_tokens=2)).choices


@pytest.mark.asyncio
async def test_values_that_ask_for_nothing_are_accepted(sdk):
    reply = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **ACCEPTED_CHAT)
    assert reply.choices[0].message.content == "Hello, world!"
    reply = await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4, **ACCEPTED_COMPLETIONS)
    assert reply.choices[0].text == "Hello, world!"


@pytest.mark.asyncio
async def test_logprobs_in_openai_shapes(sdk):
    """The SDK parses both shapes (the fake fabric's numbers: -0.5 per token, alternatives a nat apart)."""
    reply = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hello", ",", " world", "!"]
    assert [c.logprob for c in content] == [-0.5, -1.0, -1.5, -2.0]
    assert content[2].bytes == list(b" world") and [t.token for t in content[2].top_logprobs] == [" world", "alt0"]
    chunks = [c async for c in await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                                                 stream=True)]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == [(c.token, c.logprob, []) for c in content]
    plain = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert plain.choices[0].logprobs is None
    text = await sdk.completions.create(model=MODEL, prompt="hi", logprobs=1)
    legacy = text.choices[0].logprobs
    assert legacy.tokens == ["Hello", ",", " world", "!"] and legacy.text_offset == [0, 5, 6, 12]
    assert legacy.token_logprobs == [-0.5, -1.0, -1.5, -2.0] and legacy.top_logprobs[0] == {"Hello": -0.5}
    chunks = [c async for c in await sdk.completions.create(model=MODEL, prompt="hi", logprobs=1, stream=True)]
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == [0, 5, 6, 12]


def _sdk_fields(params) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


def test_every_field_the_sdk_can_send_has_a_rule():
    from openai.types import completion_create_params as text_params
    from openai.types.chat import completion_create_params as chat_params

    for endpoint, params in ((CHAT, chat_params), (COMPLETIONS, text_params)):
        missing = {f for f in _sdk_fields(params) if f not in FIELDS or endpoint not in FIELDS[f].endpoints}
        assert not missing, f"{endpoint}: no rule for {sorted(missing)}"


def test_the_readme_lists_every_field():
    text = README.read_text()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n#")]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    assert listed == set(FIELDS)
