"""The web UI's OpenAI-compatible API through Quart's test client, over a fake fabric client."""
from __future__ import annotations

import asyncio
import json

import pytest

from fabric.wire.protocol import ErrorCode, Event, Sampling
from webui import WebUIConfig, create_app
from webui.sse import DONE
from webui.testing import FakeClient, Script

pytestmark = pytest.mark.asyncio

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def chat_body(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def text_body(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


def sse_payloads(raw: bytes) -> list:
    """The data of each SSE event: parsed JSON, or the string "[DONE]"."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture
def config() -> WebUIConfig:
    return WebUIConfig()


@pytest.fixture
def app(config, fake):
    return create_app(config, fake)


@pytest.fixture
def client(app):
    return app.test_client()


def accounting(app) -> dict:
    return app.extensions["meshnet"].accounting.snapshot()


async def post(client, path, body=None, *, data=None, headers=None):
    if data is not None:
        response = await client.post(path, data=data, headers=headers or {})
    else:
        response = await client.post(path, json=body, headers=headers or {})
    return response.status_code, response


async def assert_error(response, status: int, *, code=None, param=None, type_=None) -> dict:
    assert response.status_code == status, await response.get_data()
    body = await response.get_json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    if type_ is not None:
        assert body["error"]["type"] == type_
    return body["error"]


# --------------------------------------------------------------------------- models


async def test_models_lists_fabric_models(client):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = await response.get_json()
    assert body["object"] == "list"
    assert body["data"] == [{"id": MODEL, "object": "model", "created": 0, "owned_by": "meshnet",
                             "meshnet": {"num_layers": 30, "nodes": 2, "routable": True}}]


async def test_model_retrieve_and_unknown(client):
    response = await client.get(f"/v1/models/{MODEL}")
    assert response.status_code == 200
    assert (await response.get_json())["id"] == MODEL
    await assert_error(await client.get("/v1/models/nope"), 404, code="model_not_found", param="model")


async def test_models_when_tracker_fails(fake, client):
    fake.models_error = ErrorCode.INTERNAL
    await assert_error(await client.get("/v1/models"), 503, type_="server_error")


async def test_health_says_whether_a_request_can_be_served_now(fake):
    client = create_app(WebUIConfig(pub=None, api_keys=frozenset({"sk-1"})), fake).test_client()  # needs no key
    ok = await client.get("/health")
    assert ok.status_code == 200 and await ok.get_json() == {"status": "ok", "models": [MODEL]}
    fake.model_list = [{"id": MODEL, "num_layers": 30, "nodes": 1, "routable": False}]
    partial = await client.get("/health")
    assert partial.status_code == 503 and "every layer" in (await partial.get_json())["reason"]
    fake.model_list = []
    assert "no node" in (await (await client.get("/health")).get_json())["reason"]
    fake.models_error = ErrorCode.INTERNAL
    down = await client.get("/health")
    assert down.status_code == 503 and (await down.get_json())["status"] == "unavailable"


# --------------------------------------------------------------------------- chat, non-stream


async def test_chat_non_stream(fake, client, app):
    status, response = await post(client, CHAT, chat_body())
    assert status == 200
    body = await response.get_json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and response.headers["X-Request-Id"] == body["id"]
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    (call,) = fake.calls
    assert call.model == MODEL and call.messages == [{"role": "user", "content": "hi"}]
    assert call.prompt is None and call.request_id == body["id"] and call.api_key is None
    assert fake.streams[0].finished
    assert accounting(app)["total"] == {"requests": 1, "completed": 1, "failed": 0, "cancelled": 0,
                                        "prompt_tokens": 7, "completion_tokens": 4}


async def test_chat_finish_length_when_max_tokens_cuts(fake, client):
    status, response = await post(client, CHAT, chat_body(max_tokens=2))
    body = await response.get_json()
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == "Hello,"
    assert body["usage"]["completion_tokens"] == 2
    assert fake.calls[0].max_tokens == 2


async def test_chat_passes_every_field(fake, client):
    body = chat_body(messages=[{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"},
                               {"role": "user", "content": "again", "name": "ignored"}],
                     stop=["\n", "END"], seed=42, temperature=0.5, top_p=0.9, top_k=40,
                     max_completion_tokens=3, n=1, stream=False, user="someone", presence_penalty=0)
    status, _ = await post(client, CHAT, body)
    assert status == 200
    (call,) = fake.calls
    assert call.messages[-1] == {"role": "user", "content": "again"}
    assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "user"]
    assert call.stop == ("\n", "END")
    assert call.sampling == Sampling(temperature=0.5, top_k=40, top_p=0.9, seed=42)
    assert call.max_tokens == 3


async def test_content_as_text_parts_and_the_developer_role_reach_the_fabric_as_text_and_system(fake, client):
    """OpenAI's newer shapes, which its SDK and agent frameworks send: content as an array of
    parts (text parts joined by newlines, as vLLM joins them) and "developer" for "system"."""
    body = chat_body(messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                               {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                            {"type": "text", "text": "there"}]},
                               {"role": "assistant", "content": None, "tool_calls": [
                                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                               {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}])
    status, _ = await post(client, CHAT, body)
    assert status == 200
    (call,) = fake.calls
    assert [(m["role"], m["content"]) for m in call.messages] == [
        ("system", "be brief"), ("user", "hi\nthere"), ("assistant", None), ("tool", "42")]


async def test_chat_defaults(fake, client):
    status, _ = await post(client, CHAT, chat_body())
    assert status == 200
    call = fake.calls[0]
    assert call.sampling == Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=None)
    assert call.max_tokens == 256 and call.stop == ()


async def test_configured_defaults_apply(fake):
    config = WebUIConfig(default_max_tokens=9, default_temperature=0.0)
    client = create_app(config, fake).test_client()
    status, _ = await post(client, CHAT, chat_body())
    assert status == 200
    assert fake.calls[0].max_tokens == 9 and fake.calls[0].sampling.temperature == 0.0


@pytest.mark.parametrize("stop, expected", [("x", ("x",)), (["a", "b"], ("a", "b")), (None, ()), ([], ())])
async def test_stop_string_or_list(fake, client, stop, expected):
    status, _ = await post(client, CHAT, chat_body(stop=stop))
    assert status == 200
    assert fake.calls[0].stop == expected


async def test_ignore_eos_reaches_the_fabric_and_must_be_a_boolean(fake, client):
    status, _ = await post(client, CHAT, chat_body(ignore_eos=True))
    assert status == 200 and fake.calls[0].ignore_eos is True
    status, _ = await post(client, TEXT, {"model": MODEL, "prompt": "hi"})
    assert status == 200 and fake.calls[1].ignore_eos is False
    status, response = await post(client, CHAT, chat_body(ignore_eos="yes"))
    await assert_error(response, 400, param="ignore_eos")


async def test_max_completion_tokens_wins_over_max_tokens(fake, client):
    status, _ = await post(client, CHAT, chat_body(max_tokens=2, max_completion_tokens=3))
    assert status == 200 and fake.calls[0].max_tokens == 3


async def test_unicode_round_trip(fake, client):
    text = "héllo 😀 — 你好 \u0000 \\n"
    status, response = await post(client, CHAT, chat_body(messages=[{"role": "user", "content": text}],
                                                         stop="😀"))
    assert status == 200
    assert fake.calls[0].messages[0]["content"] == text and fake.calls[0].stop == ("😀",)
    fake.script = Script(tokens=("😀", " ünï"))
    status, response = await post(client, CHAT, chat_body(stream=True))
    chunks = sse_payloads(await response.get_data())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "😀 ünï"


# --------------------------------------------------------------------------- chat, stream


async def test_chat_stream_chunks(fake, client, app):
    status, response = await post(client, CHAT, chat_body(stream=True))
    assert status == 200
    assert response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    raw = await response.get_data()
    assert raw.endswith(DONE)
    chunks = sse_payloads(raw)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["finish_reason"] is None
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert deltas == ["Hello", ",", " world", "!"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert fake.streams[0].finished
    assert accounting(app)["total"]["completion_tokens"] == 4


async def test_chat_stream_length(client):
    _, response = await post(client, CHAT, chat_body(stream=True, max_tokens=1))
    chunks = sse_payloads(await response.get_data())
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_include_usage(client):
    body = chat_body(stream=True, stream_options={"include_usage": True})
    _, response = await post(client, CHAT, body)
    chunks = sse_payloads(await response.get_data())
    assert chunks[-1] == "[DONE]"
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    assert usage_chunk["object"] == "chat.completion.chunk"
    assert all(c["usage"] is None for c in chunks[:-2])
    assert chunks[-3]["choices"][0]["finish_reason"] == "stop"


async def test_stream_options_without_include_usage(client):
    _, response = await post(client, CHAT, chat_body(stream=True, stream_options={}))
    chunks = sse_payloads(await response.get_data())
    assert all("usage" not in c for c in chunks[:-1])


async def test_stream_options_needs_stream(client):
    status, response = await post(client, CHAT, chat_body(stream_options={"include_usage": True}))
    await assert_error(response, 400, param="stream_options")


async def test_mid_stream_error_becomes_error_event(fake, client, app):
    fake.script = Script(error_after=2)
    status, response = await post(client, CHAT, chat_body(stream=True))
    assert status == 200
    chunks = sse_payloads(await response.get_data())
    assert chunks[-1] == "[DONE]"
    error = chunks[-2]
    assert error == {"error": {"message": "fake hop failure", "type": "server_error", "param": None,
                               "code": "hop_failed"}}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]] == ["Hello", ","]
    assert accounting(app)["total"]["failed"] == 1


async def test_mid_generation_error_non_stream(fake, client, app):
    fake.script = Script(error_after=1)
    status, response = await post(client, CHAT, chat_body())
    await assert_error(response, 502, code="hop_failed", type_="server_error")
    assert fake.streams[0].aclosed
    assert accounting(app)["total"]["failed"] == 1


# --------------------------------------------------------------------------- completions


async def test_completions_non_stream(fake, client):
    status, response = await post(client, TEXT, text_body(max_tokens=3, stop="\n", seed=1))
    assert status == 200
    body = await response.get_json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "Hello, world", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    (call,) = fake.calls
    assert call.prompt == "Once upon a time" and call.messages is None
    assert call.stop == ("\n",) and call.sampling.seed == 1 and call.max_tokens == 3


async def test_completions_stream_with_usage(client):
    body = text_body(stream=True, stream_options={"include_usage": True})
    status, response = await post(client, TEXT, body)
    assert status == 200 and response.mimetype == "text/event-stream"
    chunks = sse_payloads(await response.get_data())
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["total_tokens"] == 11
    texts = chunks[:-2]
    assert all(c["object"] == "text_completion" for c in texts)
    assert "".join(c["choices"][0]["text"] for c in texts) == "Hello, world!"
    assert texts[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in texts[:-1])


async def test_completions_prompt_as_an_array_of_one_string(fake, client):
    status, _ = await post(client, TEXT, {"model": MODEL, "prompt": ["Once upon"], "max_tokens": 2})
    assert status == 200 and fake.calls[0].prompt == "Once upon"


async def test_completions_stream_without_usage(client):
    _, response = await post(client, TEXT, text_body(stream=True))
    chunks = sse_payloads(await response.get_data())
    assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2, 3]]}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 3]}, "prompt"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 3}, "n"),
])
async def test_completions_validation(client, body, param):
    _, response = await post(client, TEXT, body)
    await assert_error(response, 400, param=param, type_="invalid_request_error")


# --------------------------------------------------------------------------- validation


BAD_CHAT_FIELDS = [
    ({"model": None}, "model"),
    ({"model": 5}, "model"),
    ({"model": ""}, "model"),
    ({"model": "m" * 300}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]}, "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": 5, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "ok"}, {"content": "x"}]}, "messages[1].role"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": 10 ** 400}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -1}, "top_p"),
    ({"top_p": "1"}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": 10 ** 30}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": False}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 4097}, "max_tokens"),
    ({"max_tokens": 10 ** 30}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"n": "1"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"stream": True, "stream_options": "usage"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stop": 5}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
]


@pytest.mark.parametrize("fields, param", BAD_CHAT_FIELDS)
async def test_chat_validation(fake, client, fields, param):
    _, response = await post(client, CHAT, chat_body(**fields))
    await assert_error(response, 400, param=param, type_="invalid_request_error")
    assert fake.calls == []


@pytest.mark.parametrize("fields", [
    {"temperature": 0}, {"temperature": 2}, {"temperature": 0.7}, {"top_p": 1}, {"top_p": 0.01},
    {"top_k": 0}, {"seed": 0}, {"seed": 2 ** 63 - 1}, {"max_tokens": 4096}, {"max_tokens": 1},
    {"n": 1}, {"n": None}, {"stream": False}, {"seed": None}, {"temperature": None},
])
async def test_chat_valid_edges(client, fields):
    status, response = await post(client, CHAT, chat_body(**fields))
    assert status == 200, await response.get_data()


async def test_prompt_too_long_is_400(fake):
    client = create_app(WebUIConfig(max_prompt_chars=10), fake).test_client()
    long_chat = chat_body(messages=[{"role": "user", "content": "x" * 6}, {"role": "user", "content": "y" * 6}])
    _, response = await post(client, CHAT, long_chat)
    await assert_error(response, 400, code="context_length_exceeded", param="messages")
    _, response = await post(client, TEXT, text_body(prompt="z" * 11))
    await assert_error(response, 400, code="context_length_exceeded", param="prompt")
    assert fake.calls == []


async def test_max_tokens_limit_is_configurable(fake):
    client = create_app(WebUIConfig(max_tokens_limit=8, default_max_tokens=8), fake).test_client()
    _, response = await post(client, CHAT, chat_body(max_tokens=9))
    await assert_error(response, 400, param="max_tokens")
    status, _ = await post(client, CHAT, chat_body(max_tokens=8))
    assert status == 200


# --------------------------------------------------------------------------- malformed bodies


BAD_BODIES = [
    b"", b"not json", b"{", b"[1, 2]", b"[]", b'"a string"', b"null", b"42", b"true",
    b"\xff\xfe\x00garbage", b'{"model": "\xff\xfe"}', b'{"model": NaN}', b'{"temperature": Infinity}',
    b'{"temperature": -Infinity, "model": "m"}', b"[" * 100_000, b'{"a":' * 50_000,
    b'{"max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "\\udfff", "prompt": "x"}',
    b'{"model": "smollm2-135m", "prompt": "x", "stop": "\\ud83d"}',
    b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
]


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("data", BAD_BODIES)
async def test_malformed_bodies_are_400(fake, client, path, data):
    _, response = await post(client, path, data=data, headers={"Content-Type": "application/json"})
    await assert_error(response, 400, type_="invalid_request_error")
    assert fake.calls == []


WEIRD_VALUES = [None, True, False, 0, -1, 1, 0.5, 1e308, -1e308, 10 ** 40, "", "x", "😀", [], {}, [1],
                ["x"], {"a": 1}, [{"role": "user", "content": "x"}], "\u0000"]
FIELDS = ["model", "messages", "prompt", "stop", "seed", "temperature", "top_p", "top_k", "max_tokens",
          "max_completion_tokens", "n", "stream", "stream_options"]


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("field", FIELDS)
async def test_no_field_value_gives_5xx(client, path, field):
    base = chat_body() if path == CHAT else text_body()
    for value in WEIRD_VALUES:
        status, response = await post(client, path, {**base, field: value})
        assert status < 500, (field, value, await response.get_data())
        if status == 200:
            await response.get_data()


async def test_weird_message_items_never_5xx(client):
    items = [None, 1, "x", [], {}, {"role": None}, {"role": "user", "content": {}},
             {"role": ["user"], "content": "x"}, {"role": "user", "content": "x", "extra": [1, 2]}]
    for item in items:
        status, _ = await post(client, CHAT, chat_body(messages=[item]))
        assert status in (200, 400), item


async def test_body_too_large_is_413_json(fake):
    client = create_app(WebUIConfig(max_body_bytes=1024), fake).test_client()
    _, response = await post(client, CHAT, chat_body(messages=[{"role": "user", "content": "x" * 4096}]))
    await assert_error(response, 413)


async def test_unknown_route_and_method_are_json_errors(client):
    await assert_error(await client.get("/v1/nope"), 404)
    await assert_error(await client.get(CHAT), 405)
    response = await client.get("/nope")
    assert response.status_code == 404 and response.mimetype == "text/html"


# --------------------------------------------------------------------------- fabric errors


FABRIC_ERRORS = [
    (ErrorCode.UNKNOWN_MODEL, 404, "model_not_found"),
    (ErrorCode.NO_ROUTE, 503, "no_route"),
    (ErrorCode.BUSY, 429, "busy"),
    (ErrorCode.BAD_REQUEST, 400, "bad_request"),
    (ErrorCode.PROMPT_TOO_LONG, 400, "context_length_exceeded"),
    (ErrorCode.HOP_FAILED, 502, "hop_failed"),
    (ErrorCode.INTERNAL, 500, "internal"),
    (ErrorCode.CANCELLED, 503, "cancelled"),
]


@pytest.mark.parametrize("raise_on_call", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code, status, api_code", FABRIC_ERRORS)
async def test_fabric_errors_before_first_event(fake, client, app, code, status, api_code, stream, raise_on_call):
    fake.script = Script(error_before=code, raise_on_call=raise_on_call)
    for path, body in ((CHAT, chat_body(stream=stream)), (TEXT, text_body(stream=stream))):
        _, response = await post(client, path, body)
        await assert_error(response, status, code=api_code)
    assert all(s.aclosed for s in fake.streams)
    assert accounting(app)["total"]["failed"] == 2


async def test_unknown_model_is_404(client):
    _, response = await post(client, CHAT, chat_body(model="nope"))
    await assert_error(response, 404, code="model_not_found", param="model", type_="invalid_request_error")


async def test_fabric_timeout_is_504():
    class SlowClient(FakeClient):
        def generate(self, model, **kwargs):
            raise TimeoutError

    client = create_app(WebUIConfig(), SlowClient()).test_client()
    _, response = await post(client, CHAT, chat_body())
    await assert_error(response, 504, code="timeout")


async def test_unexpected_client_bug_is_json_500():
    class BuggyClient(FakeClient):
        def generate(self, model, **kwargs):
            raise RuntimeError("bug")

    client = create_app(WebUIConfig(), BuggyClient()).test_client()
    _, response = await post(client, CHAT, chat_body())
    await assert_error(response, 500, code="internal", type_="server_error")


# --------------------------------------------------------------------------- auth


@pytest.fixture
def keyed(fake):
    return create_app(WebUIConfig(api_keys=frozenset({"sk-good", "sk-other"})), fake).test_client()


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "sk-good"}, {"Authorization": "Basic sk-good"},
    {"Authorization": "Bearer "}, {"Authorization": "Bearer sk-good2"}, {"Authorization": "Bearer sk-goo"},
    {"Authorization": "Bearer 😀"},
])
async def test_auth_rejects(keyed, fake, headers):
    _, response = await post(keyed, CHAT, chat_body(), headers=headers)
    await assert_error(response, 401, code="invalid_api_key", type_="invalid_request_error")
    assert response.headers["WWW-Authenticate"] == "Bearer"
    await assert_error(await keyed.get("/v1/models", headers=headers), 401, code="invalid_api_key")
    assert fake.calls == []


async def test_auth_accepts_and_passes_key(keyed, fake):
    status, _ = await post(keyed, CHAT, chat_body(), headers={"Authorization": "Bearer sk-good"})
    assert status == 200
    status, _ = await post(keyed, TEXT, text_body(stream=True), headers={"Authorization": "bearer  sk-other "})
    assert status == 200
    assert [c.api_key for c in fake.calls] == ["sk-good", "sk-other"]
    response = await keyed.get("/v1/models", headers={"Authorization": "Bearer sk-good"})
    assert response.status_code == 200


async def test_auth_checked_before_body(keyed):
    _, response = await post(keyed, CHAT, data=b"not json")
    await assert_error(response, 401, code="invalid_api_key")


async def test_no_keys_means_no_auth(client, fake):
    status, _ = await post(client, CHAT, chat_body(), headers={"Authorization": "Bearer whatever"})
    assert status == 200 and fake.calls[0].api_key is None


async def test_index_is_public(keyed):
    response = await keyed.get("/")
    assert response.status_code == 200


# --------------------------------------------------------------------------- disconnects


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("path", [CHAT, TEXT])
async def test_disconnect_mid_stream_closes_generator(fake, app, path):
    fake.script = Script(hang_after=2)
    body = chat_body(stream=True) if path == CHAT else text_body(stream=True)
    async with app.test_client().request(path, method="POST",
                                         headers={"Content-Type": "application/json"}) as connection:
        await connection.send(json.dumps(body).encode())
        await connection.send_complete()
        received = b""
        async with asyncio.timeout(5):
            while b" world" not in received and received.count(b"\n\n") < 3 - (path == TEXT):
                received += await connection.receive()
        assert not fake.streams[0].aclosed
        await connection.disconnect()
    await _wait_for(lambda: fake.streams[0].aclosed)
    assert b"Hello" in received
    assert not fake.streams[0].finished
    snapshot = accounting(app)["total"]
    assert snapshot["cancelled"] == 1 and snapshot["completion_tokens"] == 2


async def test_disconnect_while_collecting_closes_generator(fake, app):
    fake.script = Script(hang_after=1)
    async with app.test_client().request(CHAT, method="POST",
                                         headers={"Content-Type": "application/json"}) as connection:
        await connection.send(json.dumps(chat_body()).encode())
        await connection.send_complete()
        await _wait_for(lambda: fake.streams and len(fake.streams[0].sent) == 2)
        await connection.disconnect()
    await _wait_for(lambda: fake.streams[0].aclosed)
    assert accounting(app)["total"]["cancelled"] == 1


async def test_disconnect_while_waiting_for_first_event(fake, app):
    fake.script = Script(hang_at_start=True)
    async with app.test_client().request(CHAT, method="POST",
                                         headers={"Content-Type": "application/json"}) as connection:
        await connection.send(json.dumps(chat_body(stream=True)).encode())
        await connection.send_complete()
        await _wait_for(lambda: fake.streams)
        await asyncio.sleep(0.01)
        await connection.disconnect()
    await _wait_for(lambda: fake.streams[0].aclosed)
    assert fake.streams[0].sent == []
    assert accounting(app)["total"]["cancelled"] == 1


# --------------------------------------------------------------------------- pieces


async def test_index_page(client):
    response = await client.get("/")
    assert response.status_code == 200 and response.mimetype == "text/html"
    html = (await response.get_data()).decode()
    assert "<title>meshnet</title>" in html
    assert 'href="/v1/models"' in html and 'href="/static/dashboard.css"' in html
    css = (await (await client.get("/static/dashboard.css")).get_data()).decode()
    assert ":root" in css and "var(--" in css


# --------------------------------------------------------------------------- async-generator sources


class GeneratorClient(FakeClient):
    """Like the real client: ``generate`` returns an async generator."""

    def __init__(self, fail_with: Exception | None = None, hang: bool = False):
        super().__init__()
        self.fail_with, self.hang, self.cleaned_up = fail_with, hang, []

    def generate(self, model, **kwargs):
        return self._events(kwargs["request_id"])

    async def _events(self, rid):
        try:
            yield Event(request_id=rid, event="start")
            yield Event(request_id=rid, event="token", text="partial", token_ids=(1,))
            if self.fail_with is not None:
                raise self.fail_with
            if self.hang:
                await asyncio.Event().wait()
            yield Event(request_id=rid, event="done", finish_reason="stop", prompt_tokens=1, completion_tokens=1)
        finally:
            self.cleaned_up.append(rid)


async def test_unexpected_mid_stream_exception_is_an_error_event():
    fake = GeneratorClient(fail_with=RuntimeError("bug"))
    client = create_app(WebUIConfig(), fake).test_client()
    status, response = await post(client, CHAT, chat_body(stream=True))
    chunks = sse_payloads(await response.get_data())
    assert status == 200 and chunks[-1] == "[DONE]"
    assert chunks[-2]["error"]["code"] == "internal" and chunks[-2]["error"]["type"] == "server_error"
    assert len(fake.cleaned_up) == 1


async def test_stream_that_ends_without_done_is_an_error_event():
    class NoDone(FakeClient):
        def generate(self, model, **kwargs):
            async def events():
                yield Event(request_id="r", event="start")
                yield Event(request_id="r", event="token", text="x")
            return events()

    client = create_app(WebUIConfig(), NoDone()).test_client()
    chunks = sse_payloads(await (await post(client, CHAT, chat_body(stream=True)))[1].get_data())
    assert chunks[-2]["error"]["type"] == "server_error" and chunks[-1] == "[DONE]"
    _, response = await post(client, CHAT, chat_body())
    await assert_error(response, 500, code="internal")


async def test_error_event_from_fabric_is_mapped():
    class ErrorEvent(FakeClient):
        def generate(self, model, **kwargs):
            async def events():
                yield Event(request_id="r", event="error", error_code=ErrorCode.BUSY, text="full")
            return events()

    client = create_app(WebUIConfig(), ErrorEvent()).test_client()
    _, response = await post(client, CHAT, chat_body(stream=True))
    error = await assert_error(response, 429, code="busy")
    assert error["message"] == "full"


async def test_disconnect_runs_async_generator_cleanup():
    fake = GeneratorClient(hang=True)
    app = create_app(WebUIConfig(), fake)
    async with app.test_client().request(CHAT, method="POST",
                                         headers={"Content-Type": "application/json"}) as connection:
        await connection.send(json.dumps(chat_body(stream=True)).encode())
        await connection.send_complete()
        received = b""
        async with asyncio.timeout(5):
            while b"partial" not in received:
                received += await connection.receive()
        await connection.disconnect()
    await _wait_for(lambda: fake.cleaned_up)
    assert accounting(app)["total"]["cancelled"] == 1
