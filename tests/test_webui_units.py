"""Unit tests for the web UI's small pieces: SSE framing, accounting, config, errors."""
from __future__ import annotations

import pytest

from webui import WebUIConfig
from webui.accounting import Accounting
from webui.errors import ApiError, from_fabric
from webui.sse import DONE, ClosingStream, comment, event


def test_sse_framing():
    assert event({"a": "é"}) == '{"a":"é"}'.join(["data: ", "\n\n"]).encode()
    assert event("line1\nline2") == b"data: line1\ndata: line2\n\n"
    assert event("x", name="error", event_id="7") == b"event: error\nid: 7\ndata: x\n\n"
    assert comment("keep-alive") == b": keep-alive\n\n"
    assert DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        event("x", name="two\nlines")


def test_an_unknown_fabric_error_code_is_a_500_with_a_message():
    error = from_fabric("something new", "")
    assert isinstance(error, ApiError) and error.status == 500 and error.message


@pytest.mark.asyncio
async def test_unstarted_stream_body_still_closes_source():
    closed = []

    async def body():
        yield b"never"

    async def on_close():
        closed.append(True)

    stream = ClosingStream(body(), on_close)
    await stream.aclose()
    assert closed == [True]


def test_accounting_records_outcomes():
    book = Accounting()
    book.record("a", "completed", prompt_tokens=3, completion_tokens=5)
    book.record("a", "failed")
    book.record("b", "cancelled", completion_tokens=2)
    snap = book.snapshot()
    assert snap["total"] == {"requests": 3, "completed": 1, "failed": 1, "cancelled": 1,
                             "prompt_tokens": 3, "completion_tokens": 7}
    assert snap["models"]["b"]["cancelled"] == 1
    with pytest.raises(ValueError):
        book.record("a", "weird")


def test_config_validation():
    assert WebUIConfig(api_keys=["k"]).api_keys == frozenset({"k"})
    for bad in ({"port": 70000}, {"default_max_tokens": 0}, {"default_max_tokens": 10, "max_tokens_limit": 5},
                {"api_keys": frozenset({""})}, {"max_prompt_chars": 0}, {"default_temperature": 3.0}):
        with pytest.raises(ValueError):
            WebUIConfig(**bad)
