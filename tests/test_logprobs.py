"""Logprobs over the fabric equal transformers' ``log_softmax`` of one process (exact mode).

Two nodes in threads (float32, the exact mode), real loopback sockets, a real tracker. The
tail computes the log-softmax of the raw logits it samples from; the reference runs the
whole model once over the prompt and the generated tokens. Float32 in another order differs
by rounding (tests/tiny_models.py): the tolerance is 1e-4.
"""
from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import torch

from fabric import AsyncClient
from fabric.compute.models import load_tokenizer, resolve
from fabric.wire import protocol as p
from tests.support import wait_for
from tests.tiny_models import reference_greedy

MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]
NEW_TOKENS = 12
TOP = 5
TOLERANCE = 1e-4


def prompt_ids(model_dir) -> list[int]:
    tok = load_tokenizer(resolve(str(model_dir)))
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


def reference_logprobs(model_dir, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of one float32 transformers pass, at each generated token's position: (n, vocab)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (seq, vocab)
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(generated)], dim=-1)


def assert_matches(events: list[p.Event], reference: torch.Tensor, top: int) -> None:
    """Each token's logprob, and its ``top`` alternatives, equal the reference's within TOLERANCE."""
    tokens = [e for e in events if e.event == p.EventKind.TOKEN and e.token_ids]
    assert len(tokens) == reference.shape[0]
    for step, event in enumerate(tokens):
        (lp,) = event.logprobs
        row = reference[step]  # (vocab,)
        assert lp.token == event.token_ids[0]
        assert abs(lp.logprob - float(row[lp.token])) < TOLERANCE, (step, lp.logprob, float(row[lp.token]))
        assert len(lp.top) == top
        want = row.topk(top).values.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(want, abs=TOLERANCE)  # likeliest first
        for alt in lp.top:  # the ids named are the reference's own, with its numbers
            assert abs(alt.logprob - float(row[alt.token])) < TOLERANCE


@pytest.fixture
def split(tiny_split):
    return tiny_split[:2]  # (cluster, model dir)


def test_greedy_logprobs_equal_transformers(split):
    cluster, model_dir = split
    prompt = prompt_ids(model_dir)
    expected = reference_greedy(model_dir, prompt, NEW_TOKENS)
    with cluster.client() as client:
        events = list(client.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS, logprobs=TOP))
    assert [t for e in events for t in e.token_ids] == expected
    assert_matches(events, reference_logprobs(model_dir, prompt, expected), TOP)
    tokens = [e for e in events if e.token_ids]
    assert all(e.logprobs[0].top[0].token == e.token_ids[0] for e in tokens)  # greedy: the likeliest
    tail = cluster.nodes["tail"]
    assert wait_for(lambda: len(tail.asks) == 0)  # the session ended: the tail forgot its ask


def test_sampled_tokens_report_the_models_logprobs(split):
    """Sampling at temperature 1.5 with top-k 8: the logprobs are still the raw model's, not the
    sampler's reshaped distribution (vLLM's default, raw_logprobs)."""
    cluster, model_dir = split
    prompt = prompt_ids(model_dir)
    with cluster.client() as client:
        events = list(client.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS, logprobs=3,
                                      temperature=1.5, top_k=8, seed=11, ignore_eos=True))
    generated = [t for e in events for t in e.token_ids]
    assert_matches(events, reference_logprobs(model_dir, prompt, generated), 3)


def test_async_client_and_zero_alternatives(split):
    """The async shell carries them too; logprobs=0 is the sampled token's alone."""
    cluster, model_dir = split

    async def stream() -> list[p.Event]:
        async with AsyncClient(cluster.endpoint, timeout=30) as client:
            return [e async for e in client.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                     logprobs=0, ignore_eos=True)]

    events = asyncio.run(stream())
    generated = [t for e in events for t in e.token_ids]
    assert_matches(events, reference_logprobs(model_dir, prompt_ids(model_dir), generated), 0)


def test_a_session_that_does_not_ask_gets_none(split):
    cluster, model_dir = split
    with cluster.client() as client:
        events = list(client.generate(model_dir.name, messages=MESSAGES, max_tokens=4, ignore_eos=True))
    assert all(e.logprobs == () for e in events)
    assert all(len(node.asks) == 0 for node in cluster.nodes.values())


# ---------------------------------------------------------------------------- the OpenAI API


async def _post(client, path: str, body: dict) -> dict | list[dict]:
    """The JSON reply, or a streamed reply's chunks."""
    response = await client.post(path, json=body)
    assert response.status_code == 200, await response.get_data()
    if not body.get("stream"):
        return await response.get_json()
    lines = (await response.get_data()).decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def _chat_entries(reply: dict | list[dict]) -> list[dict]:
    if isinstance(reply, dict):
        return reply["choices"][0]["logprobs"]["content"]
    return [e for c in reply if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]]


def _legacy(reply: dict | list[dict]) -> dict:
    parts = [reply["choices"][0]["logprobs"]] if isinstance(reply, dict) else [
        c["choices"][0]["logprobs"] for c in reply if c["choices"][0]["logprobs"]]
    return {k: [v for part in parts for v in part[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                 "text_offset")}


def test_the_openai_api_streamed_and_not_equal_transformers(split):
    """/v1/chat/completions and /v1/completions, streamed and not, over the real fabric: the
    same numbers both ways, and transformers' within 1e-4."""
    from webui import WebUIConfig, create_app

    cluster, model_dir = split
    tok = load_tokenizer(resolve(str(model_dir)))
    chat = {"model": model_dir.name, "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": TOP, "ignore_eos": True}
    text = {"model": model_dir.name, "prompt": "the quick brown", "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": TOP, "ignore_eos": True}

    async def ask() -> tuple[list, list]:
        async with AsyncClient(cluster.endpoint, timeout=30) as fabric:
            client = create_app(WebUIConfig(tracker=cluster.endpoint), fabric).test_client()
            chats = [await _post(client, "/v1/chat/completions", {**chat, "stream": s}) for s in (False, True)]
            texts = [await _post(client, "/v1/completions", {**text, "stream": s}) for s in (False, True)]
            return chats, texts

    chats, texts = asyncio.run(ask())
    with cluster.client() as fabric:  # the token ids, which the API does not name
        chat_ids = [t for e in fabric.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                ignore_eos=True) for t in e.token_ids]
        text_ids = [t for e in fabric.generate(model_dir.name, prompt="the quick brown", max_tokens=NEW_TOKENS,
                                                ignore_eos=True) for t in e.token_ids]
    whole, streamed = (_chat_entries(r) for r in chats)
    assert_same(whole, streamed)  # a second run may start from the first's kept KV: rounding apart
    reference = reference_logprobs(model_dir, prompt_ids(model_dir), chat_ids)
    for entry, row, token in zip(whole, reference, chat_ids, strict=True):
        assert entry["token"] == tok.decode([token]) and entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=TOLERANCE)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(row.topk(TOP).values.tolist(),
                                                                              abs=TOLERANCE)
    legacy_whole, legacy_streamed = (_legacy(r) for r in texts)
    assert_same(legacy_whole, legacy_streamed)
    prompt = list(tok("the quick brown", add_special_tokens=True)["input_ids"])
    reference = reference_logprobs(model_dir, prompt, text_ids)
    assert legacy_whole["tokens"] == [tok.decode([t]) for t in text_ids]
    assert legacy_whole["token_logprobs"] == pytest.approx([row[t].item() for row, t in zip(reference, text_ids)],
                                                           abs=TOLERANCE)
    assert legacy_whole["text_offset"] == [sum(len(t) for t in legacy_whole["tokens"][:i]) for i in range(NEW_TOKENS)]
    for top, row, token in zip(legacy_whole["top_logprobs"], reference, text_ids):
        values, ids = row.topk(TOP)
        expected: dict[str, float] = {}
        for i, v in [*zip(ids.tolist(), values.tolist()), (token, row[token].item())]:
            expected.setdefault(tok.decode([i]), v)  # two ids of one text: the likelier's, as the API keeps
        assert_same(top, expected)


def assert_same(a, b) -> None:
    """Equal structures, numbers within TOLERANCE."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=TOLERANCE)
    else:
        assert a == b


# ---------------------------------------------------------------------------- the wire


def test_a_session_that_asks_nothing_sends_no_extra_byte():
    """FORWARD, TOKEN and EVENT of a session without logprobs encode to the very bytes they had
    before the logprob fields existed: the fields are left out at their defaults."""
    forward = p.Forward(session="s" * 32, step=3, pos=40, start_layer=0, end_layer=2, route=(), reply_to="tcp://h:1",
                        tensors=(p.TensorSpec("int64", (1, 1)),))
    token = p.Token("s" * 32, 3, 42, 41)
    event = p.Event("r", "token", text=" fox", token_ids=(42,), completion_tokens=5)
    for message, gone in ((forward, {"logprobs"}), (token, {"logprob", "top_ids", "top_logprobs"}),
                          (event, {"logprobs"})):
        header = msgpack.unpackb(p.encode(message, [bytes(8)] * len(message.tensors))[2])
        assert not gone & header.keys()
        assert p.decode(p.encode(message, [bytes(8)] * len(message.tensors)))[0] == message
    asked = p.Token("s" * 32, 3, 42, 41, logprob=-0.25, top_ids=(42, 7), top_logprobs=(-0.25, -2.0))
    assert p.decode(p.encode(asked))[0] == asked
