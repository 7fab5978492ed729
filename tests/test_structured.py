"""Structured output: the tail masks the logits with the request's grammar, so the reply of a
model whose weights are random (its free text is noise) parses and validates.

Real 2-node fabrics on loopback, tiny random models of two families, greedy and sampled.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal

import pytest

from fabric.client import AsyncClient
from fabric.wire.protocol import Grammar, GrammarKind

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]
MAX_TOKENS = 120


def valid(text: str) -> dict:
    """``text`` parsed, checked against SCHEMA by hand (no jsonschema needed)."""
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "ok", "tags"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 999
    assert type(obj["ok"]) is bool
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b", "c"}
    return obj


@pytest.fixture
def split(tiny_split):
    return tiny_split


def reply(client, model_dir, **kw) -> tuple[str, str]:
    text, finish = "", None
    for event in client.generate(model_dir.name, max_tokens=MAX_TOKENS, **kw):
        text += event.text
        finish = event.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_replies_parse_and_validate(split, temperature):
    cluster, model_dir, _ = split
    with cluster.client() as client:
        for seed in range(3):
            text, finish = reply(client, model_dir, messages=[{"role": "user", "content": f"person {seed}"}],
                                 response_format=JSON_SCHEMA, temperature=temperature, seed=seed)
            assert finish == "stop", text
            valid(text)


def test_free_text_of_these_models_is_not_json(split):
    """The negative control: without the grammar the same requests do not parse, so the tests
    above pass because of the mask, not because of the models."""
    cluster, model_dir, _ = split
    with cluster.client() as client:
        for seed in range(3):
            text, _ = reply(client, model_dir, messages=[{"role": "user", "content": f"person {seed}"}], seed=seed)
            with pytest.raises(ValueError):
                json.loads(text)


def test_json_object_regex_and_lark_replies_match(split):
    cluster, model_dir, _ = split
    with cluster.client() as client:
        text, finish = reply(client, model_dir, prompt="the quick brown", response_format={"type": "json_object"})
        assert finish == "stop" and isinstance(json.loads(text), dict), text
        text, finish = reply(client, model_dir, messages=MESSAGES,
                             response_format=Grammar(GrammarKind.REGEX, "(yes|no), [0-9]{1,3} times"))
        assert finish == "stop" and re.fullmatch("(yes|no), [0-9]{1,3} times", text), text
        text, finish = reply(client, model_dir, messages=MESSAGES, temperature=0.8, seed=3, response_format=Grammar(
            GrammarKind.LARK, 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'))
        assert finish == "stop" and re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text), text


def test_a_re_prefill_rebuilds_the_matcher_from_the_generated_tokens(split):
    """The tail loses the session's KV mid-object: the head re-prefills, its opening FORWARD lists
    the tokens generated so far, and the tail's new matcher goes on from there."""
    cluster, model_dir, route = split
    tail = cluster.nodes["tail"]
    with cluster.client() as client:
        expected, _ = reply(client, model_dir, messages=MESSAGES, response_format=JSON_SCHEMA)
        text, misses = "", tail.counters["cache_miss"]
        for n, event in enumerate(client.generate(model_dir.name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  route=route, response_format=JSON_SCHEMA)):
            text += event.text
            if n == 6:
                for session in tail.kv.sessions():  # evicted, as an idle timeout or a restart would
                    tail.kv.drop(session)
    assert tail.counters["cache_miss"] > misses
    valid(text)
    assert text == expected  # greedy: the mask went on where it was


def test_a_bad_grammar_is_refused_by_the_head(split):
    """A client that bypasses the web UI still gets a clear bad_request naming response_format."""
    from fabric import FabricError

    cluster, model_dir, _ = split
    with cluster.client() as client, pytest.raises(FabricError) as refused:
        reply(client, model_dir, messages=MESSAGES, response_format=Grammar(GrammarKind.JSON_SCHEMA, '{"type": 5}'))
    assert refused.value.code == "bad_request" and "response_format" in refused.value.message, refused.value.message
    with cluster.client() as client:  # the nodes go on serving
        valid(reply(client, model_dir, messages=MESSAGES, response_format=JSON_SCHEMA)[0])


def test_constrained_streams_beside_a_free_one(split):
    """Five constrained streams (greedy and sampled) and a free one at once: the tail's batches
    mix them, each constrained reply validates, and the free one is what it is alone."""
    cluster, model_dir, _ = split
    with cluster.client() as client:
        free_alone = reply(client, model_dir, prompt="the quick brown", ignore_eos=True)[0]

    async def one(fabric, **kw) -> str:
        text = ""
        async for event in fabric.generate(model_dir.name, max_tokens=MAX_TOKENS, **kw):
            text += event.text
        return text

    async def together() -> list[str]:
        async with AsyncClient(cluster.endpoint, timeout=60) as fabric:
            asks = [one(fabric, messages=[{"role": "user", "content": f"person {i}"}], response_format=JSON_SCHEMA,
                        temperature=0.7 * (i % 2), seed=i) for i in range(5)]
            return await asyncio.gather(one(fabric, prompt="the quick brown", ignore_eos=True), *asks)

    free, *constrained = asyncio.run(together())
    for text in constrained:
        valid(text)
    assert free == free_alone


def test_the_openai_api_streamed_and_not(split):
    """/v1/chat/completions with json_schema and /v1/completions with json_object, streamed and
    not, over the real fabric: every reply parses, and finish_reason is "stop"."""
    from webui import WebUIConfig, create_app

    cluster, model_dir, _ = split
    chat = {"model": model_dir.name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "response_format": JSON_SCHEMA,
            "temperature": 0}
    text = {"model": model_dir.name, "prompt": "the quick brown", "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_object"}, "temperature": 0.9, "seed": 7}

    async def ask() -> list[tuple[str, str]]:
        async with AsyncClient(cluster.endpoint, timeout=30) as fabric:
            client = create_app(WebUIConfig(tracker=cluster.endpoint), fabric).test_client()
            return [await _post(client, path, {**body, "stream": stream}) for path, body in
                    (("/v1/chat/completions", chat), ("/v1/completions", text)) for stream in (False, True)]

    (chat_whole, chat_streamed, text_whole, text_streamed) = asyncio.run(ask())
    assert chat_whole == chat_streamed and ("stop" == chat_whole[1])
    valid(chat_whole[0])
    assert text_whole == text_streamed and text_whole[1] == "stop"
    assert isinstance(json.loads(text_whole[0]), dict)


async def _post(client, path: str, body: dict) -> tuple[str, str]:
    """The reply's text and finish_reason, whole or put together from its chunks."""
    response = await client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    if not body.get("stream"):
        choice = (await response.get_json())["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"], choice["finish_reason"]
    text, finish = "", None
    for line in (await response.get_data()).decode().splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish


def test_a_dead_tail_mid_object_still_yields_valid_json(process_cluster, tiny_models):
    """kill -9 the tail a few tokens into the object: the head re-plans onto the other tail,
    whose matcher starts from the tokens generated so far, and the reply is the one a route
    without a failure gives (greedy)."""
    model = tiny_models("llama")
    process_cluster.start_node("head", str(model), "0-2")
    process_cluster.start_node("tail1", str(model), "3-5")
    process_cluster.start_node("tail2", str(model), "3-5")
    process_cluster.wait_nodes(["head", "tail1", "tail2"], model.name)
    with process_cluster.client() as client:
        expected, _ = reply(client, model, messages=MESSAGES, response_format=JSON_SCHEMA)
        text, victim, tokens = "", None, 0
        for event in client.generate(model.name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                     response_format=JSON_SCHEMA):
            victim = event.route[-1].node if event.event == "start" else victim
            text += event.text
            tokens += len(event.token_ids)
            if tokens == 5:
                process_cluster.kill(victim, signal.SIGKILL)
    assert victim in ("tail1", "tail2") and tokens > 5
    valid(text)
    assert text == expected
