"""Hypothesis against the HTTP API: no input gets a 5xx, and good requests still work."""
from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webui import WebUIConfig, create_app
from webui.testing import FakeClient

PATHS = ["/v1/chat/completions", "/v1/completions"]
GOOD = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)

# bodies shaped like real requests, with every field possibly of a wrong type or value
request_bodies = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("smollm2-135m"), json_values),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({}, optional={"role": json_values | st.sampled_from(
        ["user", "system", "assistant", "tool"]), "content": json_values}), max_size=3), json_values),
    "prompt": json_values, "max_tokens": json_values, "temperature": json_values, "top_p": json_values,
    "stream": json_values, "stop": json_values, "seed": json_values, "n": json_values,
    "stream_options": json_values})

raw_bodies = st.binary(max_size=200) | st.text(max_size=200).map(str.encode)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def post_all(bodies: list[tuple[str, bytes]]) -> list[int]:
    async def run() -> list[int]:
        app = create_app(WebUIConfig(pub=None), FakeClient())
        client = app.test_client()
        codes = []
        for path, body in bodies:
            response = await client.post(path, data=body, headers={"content-type": "application/json"})
            await response.get_data()
            codes.append(response.status_code)
        good = await client.post(PATHS[0], json=GOOD)  # another request is unaffected
        codes.append(-1 if good.status_code != 200 else 200)
        return codes
    return asyncio.run(run())


@FUZZ
@given(path=st.sampled_from(PATHS), body=request_bodies)
def test_structured_bodies_never_5xx(path, body):
    codes = post_all([(path, json.dumps(body).encode())])
    assert codes[0] < 500 and codes[-1] == 200, (body, codes)


@FUZZ
@given(path=st.sampled_from(PATHS), body=raw_bodies)
def test_raw_bodies_never_5xx(path, body):
    codes = post_all([(path, body)])
    assert codes[0] < 500 and codes[-1] == 200, (body, codes)
