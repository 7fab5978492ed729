"""The Responses API (POST /v1/responses) through OpenAI's own SDK (``client.responses``), over the
web UI app and a fake fabric: a request becomes the chat it describes (what the fabric is asked),
and the reply comes back as output items, whole or as the SDK's streamed events; every field is
honoured, accepted as harmless, or refused by name."""
from __future__ import annotations

import json

import pytest

from webui import WebUIConfig, create_app
from webui.responses import RULES
from webui.testing import FakeClient, Script

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.asyncio
MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def sdk_for(fake: FakeClient, app=None, key: str = "unused"):
    app = app or create_app(WebUIConfig(pub=None), fake)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webui")
    return openai.AsyncOpenAI(base_url="http://webui/v1", api_key=key, http_client=http, max_retries=0)


async def test_a_text_reply_whole_and_what_the_fabric_was_asked():
    fake = FakeClient()
    response = await sdk_for(fake).responses.create(
        model=MODEL, instructions="be brief", max_output_tokens=50, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
               {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
               {"role": "developer", "content": "again"}])
    assert response.output_text == "Hello, world!" and response.status == "completed"
    assert response.usage.input_tokens == 7 and response.usage.output_tokens == 4
    (call,) = fake.calls
    assert [(m["role"], m["content"]) for m in call.messages] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("system", "again")]
    assert call.max_tokens == 50 and call.sampling.temperature == 0


async def test_a_reply_cut_by_max_output_tokens_is_incomplete_and_streams_in_order():
    fake = FakeClient()
    stream = await sdk_for(fake).responses.create(model=MODEL, input="hi", max_output_tokens=2, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello,"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # as vLLM sends it: the SDK's stream helpers wait for it
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.output_text == "Hello,"
    async with sdk_for(fake).responses.stream(model=MODEL, input="hi", max_output_tokens=2) as helper:
        assert (await helper.get_final_response()).output_text == "Hello,"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


@pytest.mark.parametrize("stream", [False, True])
async def test_function_calls_come_as_items_and_their_outputs_go_back_as_tool_messages(stream):
    fake = FakeClient(script=Script(tokens=("Let me look.\n", CALL)))
    sdk = sdk_for(fake)
    ask = dict(model=MODEL, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               input=[{"role": "user", "content": "weather?"},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_1", "output": "rain"}])
    if stream:
        events = [e async for e in await sdk.responses.create(**ask, stream=True)]
        assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == ['{"city": "Oslo"}']
        response = events[-1].response
    else:
        response = await sdk.responses.create(**ask)
    message, call = response.output
    assert message.content[0].text == "Let me look." and call.type == "function_call"
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Oslo"}, "completed")
    asked = fake.calls[0]
    assert [m["role"] for m in asked.messages] == ["user", "assistant", "tool"]
    assert asked.messages[1]["tool_calls"][0]["id"] == "call_1" and asked.messages[2]["content"] == "rain"
    assert asked.tools.name == "get_weather" and asked.tools.functions[0]["function"]["name"] == "get_weather"


async def test_a_json_schema_format_becomes_the_grammar():
    fake = FakeClient()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    await sdk_for(fake).responses.create(model=MODEL, input="x", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert json.loads(fake.calls[0].response_format.source) == schema


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"store": "yes"}, "store"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"min_p": 0.1}, "min_p"),
])
async def test_what_this_server_cannot_do_is_refused_by_name(fields, param):
    fake = FakeClient()
    body = {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk_for(fake).post("/responses", body=body, cast_to=object)
    assert refused.value.body["param"] == param and fake.calls == []


async def test_the_readme_lists_every_field():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("### The Responses API"):]
    for name, rule in RULES.items():
        assert f"| `{name}` | {rule.does} |" in table, name


async def test_every_field_the_sdk_can_send_has_a_rule():
    import typing

    from openai.types.responses import response_create_params as params

    missing = set(typing.get_type_hints(params.ResponseCreateParamsBase)) | {"stream"}
    assert not missing - set(RULES), sorted(missing - set(RULES))


@pytest.mark.parametrize("stream", [False, True])
async def test_previous_response_id_continues_a_kept_conversation_as_openai_s_multi_turn_example(stream):
    fake = FakeClient()
    sdk = sdk_for(fake)
    first = await sdk.responses.create(model=MODEL, instructions="be brief", input="tell me a joke")
    if stream:
        async with sdk.responses.stream(model=MODEL, input="another", previous_response_id=first.id) as events:
            second = await events.get_final_response()
    else:
        second = await sdk.responses.create(model=MODEL, input="another", previous_response_id=first.id)
    third = await sdk.responses.create(model=MODEL, input="and a third", previous_response_id=second.id,
                                       instructions="be kind")
    assert second.previous_response_id == first.id and third.output_text == "Hello, world!"
    assert [(m["role"], m["content"]) for m in fake.calls[2].messages] == [
        ("system", "be kind"),  # instructions apply to their own request only
        ("user", "tell me a joke"), ("assistant", "Hello, world!"), ("user", "another"),
        ("assistant", "Hello, world!"), ("user", "and a third")]


async def test_a_kept_call_is_continued_by_its_output():
    fake = FakeClient(script=Script(tokens=(CALL,)))
    sdk = sdk_for(fake)
    first = await sdk.responses.create(model=MODEL, input="weather?", tools=[WEATHER])
    (call,) = first.output
    await sdk.responses.create(model=MODEL, tools=[WEATHER], previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    asked = fake.calls[1].messages
    assert [m["role"] for m in asked] == ["user", "assistant", "tool"]
    assert asked[1]["tool_calls"][0]["id"] == call.call_id and asked[2]["tool_call_id"] == call.call_id


async def test_what_is_not_kept_cannot_be_continued():
    fake = FakeClient()
    app = create_app(WebUIConfig(pub=None, api_keys=frozenset({"sk-a", "sk-b"})), fake)
    alice, bob = sdk_for(fake, app, "sk-a"), sdk_for(fake, app, "sk-b")
    kept = await alice.responses.create(model=MODEL, input="mine")
    unkept = await alice.responses.create(model=MODEL, input="forget it", store=False)
    assert unkept.store is False
    for sdk, response_id in ((bob, kept.id), (alice, unkept.id), (alice, "resp_nobody")):
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.responses.create(model=MODEL, input="next", previous_response_id=response_id)
        assert refused.value.body["code"] == "previous_response_not_found"
    assert len(fake.calls) == 2  # nothing reached the fabric for the refused ones


async def test_the_store_keeps_the_last_ones_only():
    from webui.responses_store import ResponseStore

    store = ResponseStore(max_kept=2)
    for i in range(3):
        store.put("", f"r{i}", [{"role": "user", "content": str(i)}], [])
    assert store.get("", "r0") is None and len(store) == 2
    assert store.get("", "r2") == [{"role": "user", "content": "2"}, {"role": "assistant", "content": ""}]
