"""The web UI served by hypercorn on a real loopback socket: the openai SDK, raw SSE, Ctrl-C."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

from tests.support import free_port
from webui import WebUIConfig
from webui.app import serve_async
from webui.testing import FakeClient, Script

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
KEY = "sk-test"


async def wait_listening(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


@pytest_asyncio.fixture(loop_scope="function")
async def server():
    """(port, fake client) with the app served by hypercorn; stops and checks on teardown."""
    fake = FakeClient()
    port = free_port()
    stop = asyncio.Event()
    config = WebUIConfig(port=port, api_keys=frozenset({KEY}))
    task = asyncio.create_task(serve_async(config, client_factory=lambda _: fake, shutdown_trigger=stop.wait))
    await wait_listening(port)
    yield port, fake
    stop.set()
    await asyncio.wait_for(task, 15)
    assert fake.closed


async def raw_request(port: int, path: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


@pytest.mark.asyncio
async def test_sse_over_real_socket_and_disconnect(server):
    port, fake = server
    fake.script = Script(hang_after=2)
    reader, writer = await raw_request(port, "/v1/chat/completions",
                                       {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    received = b""
    async with asyncio.timeout(10):
        while b'"content":","' not in received:
            received += await reader.read(4096)
    assert received.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in received and b'"content":"Hello"' in received
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(10):
        while not fake.streams[0].aclosed:
            await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_openai_sdk(server):
    openai = pytest.importorskip("openai")
    port, fake = server
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    def drive() -> None:
        assert [m.id for m in sdk.models.list()] == [MODEL]
        chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           temperature=0, seed=3, stop=["\n"])
        assert chat.choices[0].message.content == "Hello, world!"
        assert chat.choices[0].finish_reason == "stop" and chat.usage.total_tokens == 11
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  stream=True, stream_options={"include_usage": True},
                                                  max_completion_tokens=3))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 3
        text = sdk.completions.create(model=MODEL, prompt="Once", max_tokens=2)
        assert text.choices[0].text == "Hello,"
        streamed = list(sdk.completions.create(model=MODEL, prompt="Once", stream=True))
        assert "".join(c.choices[0].text for c in streamed) == "Hello, world!"

    await asyncio.to_thread(drive)
    assert fake.calls[0].sampling.seed == 3 and fake.calls[0].stop == ("\n",)


@pytest.mark.asyncio
async def test_openai_sdk_errors(server):
    openai = pytest.importorskip("openai")
    port, fake = server
    base = f"http://127.0.0.1:{port}/v1"

    def drive() -> None:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        sdk = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError) as err:
            sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model=MODEL, messages=[], temperature=0)
        fake.script = Script(error_before="busy")
        with pytest.raises(openai.RateLimitError):
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        fake.script = Script(error_before="no_route")
        with pytest.raises(openai.InternalServerError) as err:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503

    await asyncio.to_thread(drive)


SERVE_SCRIPT = """
import logging, sys
from webui import WebUIConfig, serve
from webui.testing import FakeClient
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
class Client(FakeClient):
    async def close(self):
        logging.getLogger("test").info("fake client closed")
serve(WebUIConfig(port=int(sys.argv[1])), client_factory=lambda config: Client())
"""


@pytest.mark.asyncio
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_serve_stops_cleanly_on_signal(sig):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        await wait_listening(port, 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
        writer.close()
        proc.send_signal(sig)
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "fake client closed" in stderr and "meshnet web UI stopped" in stderr
    assert "Traceback" not in stderr
