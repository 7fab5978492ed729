"""Structured output: the tail masks the logits with the request's grammar, so the reply of a
model whose weights are random (its free text is noise) parses and validates.

Real 2-node fabrics on loopback, tiny random models of two families, greedy and sampled.
"""
from __future__ import annotations

import json

import pytest

from fabric.wire.protocol import Hop

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


@pytest.fixture(params=["llama", "qwen3"])
def split(request, thread_cluster, tiny_models):
    model_dir = tiny_models(request.param)
    head = thread_cluster.add_node(model_dir, 0, 2, 6, "head")
    tail = thread_cluster.add_node(model_dir, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model_dir.name, 2)
    return thread_cluster, model_dir, (Hop("head", head.endpoint, 0, 2), Hop("tail", tail.endpoint, 3, 5))


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
