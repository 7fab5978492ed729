"""Tool calls over a real 2-node fabric on loopback: tiny random models of two families, each
with a chat template that renders tools in its family's syntax (hermes's ``<tool_call>`` for
qwen3, llama 3's bare JSON for llama).

A random model's free text is noise, so a call that parses and whose arguments validate shows
the tail's grammar at work (the "auto" control below parses nothing from the same prompts).
"""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from fabric.client import AsyncClient
from fabric.toolcalls import SYNTAXES, parse_reply
from tests.tiny_models import HERMES_TOOLS_TEMPLATE, LLAMA3_TOOLS_TEMPLATE, with_template

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
NAMES = {"get_weather", "add"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 120
TEMPLATES = {"qwen3": ("hermes", HERMES_TOOLS_TEMPLATE), "llama": ("llama3", LLAMA3_TOOLS_TEMPLATE)}


def valid_arguments(name: str, arguments: str) -> dict:
    """``arguments`` (JSON text) checked against ``name``'s parameters by hand."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days", "unit"}, args
        assert isinstance(args["city"], str) and len(args["city"]) <= 10
        assert type(args["days"]) is int and 1 <= args["days"] <= 7 and args["unit"] in ("c", "f")
    else:
        assert name == "add" and set(args) == {"a", "b"}, args
        assert all(type(v) is int and -99 <= v <= 99 for v in args.values())
    return args


@pytest.fixture(params=sorted(TEMPLATES))
def tools_split(request, thread_cluster, tiny_models, tmp_path_factory):
    """A head (layers 0-2) and a tail (3-5) of a tiny model whose template renders tools:
    (cluster, model dir, the syntax its template writes)."""
    family = request.param
    syntax, template = TEMPLATES[family]
    model_dir = with_template(tiny_models(family), tmp_path_factory.mktemp("tools") / f"{family}-tools", template)
    thread_cluster.add_node(model_dir, 0, 2, 6, "head")
    thread_cluster.add_node(model_dir, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model_dir.name, 2)
    return thread_cluster, model_dir, syntax


def reply(client, model_dir, max_tokens=MAX_TOKENS, **kw) -> tuple[str, str, str]:
    """(text, finish_reason, the start event's tool_syntax) of one request."""
    text, finish, syntax = "", None, None
    for event in client.generate(model_dir.name, max_tokens=max_tokens, **kw):
        if event.event == "start":
            syntax = event.tool_syntax
        text += event.text
        finish = event.finish_reason or finish
    return text, finish, syntax


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"the quick brown fox {i}"}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_function_is_always_called_with_valid_arguments(tools_split, temperature):
    cluster, model_dir, syntax = tools_split
    with cluster.client() as client:
        for seed in range(3):
            text, finish, named = reply(client, model_dir, messages=ask(seed), tools=TOOLS, tool_choice=NAMED,
                                        parallel_tool_calls=False, temperature=temperature, seed=seed)
            assert (finish, named) == ("stop", syntax), text
            content, calls = parse_reply(text, SYNTAXES[syntax], NAMES)
            assert content is None and len(calls) == 1, text
            for call in calls:
                assert call.name == "get_weather" and call.id.startswith("call_")
                valid_arguments(call.name, call.arguments)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_any_offered_function_validly(tools_split, parallel):
    """With parallel calls a random model rarely ends before the bound (16 calls), so those
    replies get room for all of them."""
    cluster, model_dir, syntax = tools_split
    with cluster.client() as client:
        for seed in range(3 if not parallel else 2):
            text, finish, _ = reply(client, model_dir, messages=ask(seed), tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=parallel, temperature=0.9, seed=seed,
                                    max_tokens=MAX_TOKENS if not parallel else 2000)
            content, calls = parse_reply(text, SYNTAXES[syntax], NAMES)
            assert finish == "stop" and content is None and calls, text
            assert len(calls) == 1 or parallel and len(calls) <= 16, text
            for call in calls:
                valid_arguments(call.name, call.arguments)


def test_auto_leaves_the_free_text_of_a_random_model_as_content(tools_split):
    """The negative control: the same requests without a required call parse to no call (so
    the tests above pass because of the grammar), and "none" names no syntax to parse by."""
    cluster, model_dir, syntax = tools_split
    with cluster.client() as client:
        for seed in range(3):
            text, _, named = reply(client, model_dir, messages=ask(seed), tools=TOOLS, seed=seed, temperature=0.9)
            assert named == syntax
            assert parse_reply(text, SYNTAXES[syntax], NAMES) == (text, []), text
        assert reply(client, model_dir, messages=ask(0), tools=TOOLS, tool_choice="none")[2] == ""


def test_history_with_calls_and_tool_results_renders(tools_split):
    cluster, model_dir, syntax = tools_split
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [*ask(0), {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    with cluster.client() as client:
        text, finish, _ = reply(client, model_dir, messages=history, tools=TOOLS, tool_choice="required", seed=1,
                                parallel_tool_calls=False)
        assert finish == "stop" and parse_reply(text, SYNTAXES[syntax], NAMES)[1], text


def test_a_template_without_tools_gets_them_written_in_and_calls_as_hermes(tiny_split):
    """The tiny models' own template knows only roles and content (as SmolLM2's does): the head
    writes the tools into the system message, and a named call comes back in hermes syntax."""
    from fabric.compute.models import load_tokenizer, resolve
    from fabric.node.route_session import encode_prompt
    from fabric.wire import protocol as p

    cluster, model_dir, _ = tiny_split
    tokenizer = load_tokenizer(resolve(str(model_dir)))
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [*ask(0), {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    request = p.Generate("r", (p.Hop("n", "tcp://127.0.0.1:1", 0, 5),), messages=history,
                         tools=p.Tools(tuple(TOOLS), p.ToolChoice.AUTO))
    shown = tokenizer.decode(encode_prompt(tokenizer, request, 4096))
    assert '"name": "get_weather"' in shown and "<tool_call>" in shown and "<tool_response>\n3\n" in shown, shown
    with cluster.client() as client:
        for seed in range(2):
            text, finish, named = reply(client, model_dir, messages=ask(seed), tools=TOOLS, tool_choice=NAMED,
                                        parallel_tool_calls=False, temperature=0.8, seed=seed)
            content, calls = parse_reply(text, SYNTAXES["hermes"], NAMES)
            assert (finish, named, content, len(calls)) == ("stop", "hermes", None, 1), text
            valid_arguments(calls[0].name, calls[0].arguments)


def test_auto_parses_a_call_the_reply_writes(tools_split):
    """"auto" end to end: a regex makes the random model write one call in its family's syntax,
    and the web UI hands it back as ``tool_calls`` (finish "tool_calls", no content)."""
    from webui import WebUIConfig, create_app

    cluster, model_dir, syntax = tools_split
    body = {"name": "add", SYNTAXES[syntax].arguments: {"a": 4, "b": 5}}
    text = {"hermes": f"<tool_call>\n{json.dumps(body)}\n</tool_call>", "llama3": json.dumps(body)}[syntax]
    request = {"model": model_dir.name, "messages": ask(1), "tools": TOOLS, "max_tokens": MAX_TOKENS,
               "guided_regex": re.escape(text)}

    async def post():
        async with AsyncClient(cluster.endpoint, timeout=30) as fabric:
            response = await create_app(WebUIConfig(tracker=cluster.endpoint), fabric).test_client().post(
                "/v1/chat/completions", json=request)
            return response.status_code, await response.get_json()

    status, answer = asyncio.run(post())
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 4, "b": 5}


def test_the_openai_sdk_reads_the_tool_calls_streamed_and_not(tools_split):
    """The official SDK against the web UI over the real fabric: ``message.tool_calls`` of a
    whole reply, and the calls the SDK accumulates from a stream's ``delta.tool_calls``."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx2")  # the HTTP library this openai release is built on
    from webui import WebUIConfig, create_app

    cluster, model_dir, _ = tools_split

    async def both():
        async with AsyncClient(cluster.endpoint, timeout=30) as fabric:
            app = create_app(WebUIConfig(tracker=cluster.endpoint), fabric)
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webui")
            sdk = openai.AsyncOpenAI(base_url="http://webui/v1", api_key="unused", http_client=http, max_retries=0)
            kw = dict(model=model_dir.name, messages=ask(3), tools=TOOLS, tool_choice=NAMED, max_tokens=MAX_TOKENS,
                      parallel_tool_calls=False, temperature=0.8, seed=5)
            whole = await sdk.chat.completions.create(**kw)
            async with sdk.chat.completions.stream(**kw) as stream:
                async for _ in stream:
                    pass
                streamed = await stream.get_final_completion()
            return whole.choices[0], streamed.choices[0]

    whole, streamed = asyncio.run(both())
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
        calls = choice.message.tool_calls
        assert calls and all(c.type == "function" and c.function.name == "get_weather" for c in calls)
        for c in calls:
            valid_arguments(c.function.name, c.function.arguments)
    assert [c.function.arguments for c in whole.message.tool_calls] == \
        [c.function.arguments for c in streamed.message.tool_calls]
