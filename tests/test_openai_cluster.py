"""The official openai package, unmodified, against `meshnet webui` over real processes."""
from __future__ import annotations

import http.client
import json

import pytest

from tests.cluster import wait_sessions_zero

openai = pytest.importorskip("openai")


@pytest.fixture
def served(process_cluster, tiny_models):
    model = tiny_models("llama")
    process_cluster.split(model)
    url = process_cluster.start_webui()
    return process_cluster, model.name, url


def test_openai_sdk_against_a_real_cluster(served):
    cluster, model, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert model in [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": "hello world"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy: the same text both ways
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    text = client.completions.create(model=model, prompt="the quick brown", max_tokens=6, temperature=0)
    assert text.choices[0].text
    cluster.past_warmup()  # (within it, an unknown model is "nodes register", 503)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=messages, temperature=9)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[])


def test_the_responses_api_gives_the_chat_s_greedy_text_whole_and_streamed(served):
    """The same conversation asked as a chat completion and as a response: the same tokens."""
    _, model, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "[again]"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    response = client.responses.create(model=model, instructions="be brief", input=messages[1:],
                                       max_output_tokens=12, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(model=model, instructions="be brief", input=messages[1:], max_output_tokens=12,
                                 temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == response.output_text
    assert final.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    chained = client.responses.create(model=model, previous_response_id=response.id, input="[more]",
                                      max_output_tokens=8, temperature=0)  # the kept conversation, then the input
    whole = [*messages[1:], {"role": "assistant", "content": response.output_text},
             {"role": "user", "content": "[more]"}]
    again = client.chat.completions.create(model=model, messages=whole, max_tokens=8, temperature=0)
    assert chained.output_text == again.choices[0].message.content


def test_disconnect_mid_stream_frees_every_node_within_a_second(served):
    cluster, model, url = served
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
                       "stream": True, "temperature": 0})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    seen = 0
    while seen < 3:  # a few content chunks, then hang up
        line = response.fp.readline()
        seen += line.startswith(b"data: ") and b'"content"' in line
    conn.sock.close()
    conn.close()
    wait_sessions_zero(list(cluster.node_endpoints.values()), timeout=1.0)
