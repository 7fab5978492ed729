"""The dashboard in a real browser: Playwright for Python driving Debian's chromium, headless.

The browser is never downloaded: the test uses the chromium on PATH, /usr/bin/chromium (installed by
``scripts/install.sh --test``) and skips with the reason when it or Playwright is missing.

The main test runs a real cluster (tracker + 2 nodes of a tiny random llama, in threads)
and the web UI under hypercorn. A tiny model generates faster than a page can be watched,
so the tail node runs only the steps the test allows (``StepGate``): token by token the
test sees the reply grow, sees the request on the Call wall while it is stalled mid-reply,
presses stop and checks the partial text stays. Nothing asserts on wall-clock time.
Screenshots go to artifacts/screenshots/.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import free_port, wait_sessions_zero
from tests.support.areas import skip_area
from tests.support.browser import chromium_missing
from webui import WebUIConfig
from webui.app import serve_async
from webui.testing import FakeClient

if _missing := chromium_missing():
    skip_area("browser", _missing, module=True)
from playwright import sync_api  # noqa: E402  (after the check that it is there)

SHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
REPLY = "#messages .msg.assistant >> nth=-1"
WAIT_MS = 20_000  # Playwright's patience for one page change (a bound, not an assertion)


# --------------------------------------------------------------------------- fixtures


class StepGate:
    """Lets a node execute only the hops the test releases, without ever blocking its thread.

    A held hop goes back to the front of the node's work queue, so the node keeps polling,
    heartbeating and answering CANCEL (which drops the held hop) while the request waits.
    """

    def __init__(self, node):
        self.node = node
        self.executed = 0  # hops run through the gate
        self._allowed = 0
        self._open = False
        self._lock = threading.Lock()
        self._run = node._run
        node._run = self._gated

    def _gated(self, batch) -> None:
        """Stands in for ``Node._run(batch)``: a batch of queued hops runs as one step."""
        with self._lock:
            go = self._open or self._allowed > 0
            if go and not self._open:
                self._allowed -= 1
        if not go:
            self.node.scheduler.queue.extendleft(reversed(batch))
            time.sleep(0.005)  # the node loop polls without a timeout while work is queued
            return
        self._run(batch)
        with self._lock:
            self.executed += 1

    def release(self, steps: int = 1) -> None:
        with self._lock:
            self._allowed += steps

    def open(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        with self._lock:
            self._open, self._allowed = False, 0


class WebUIThread:
    """``serve_async`` under hypercorn in a thread with its own event loop."""

    def __init__(self, config: WebUIConfig, client_factory=None):
        self.config = config
        self.url = f"http://127.0.0.1:{config.port}"
        self._factory = client_factory
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(20)
        _wait_listening(config.port)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await serve_async(self.config, client_factory=self._factory, shutdown_trigger=self._stop.wait)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the web UI did not shut down"


def _wait_listening(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def swarm(thread_cluster, tiny_models):
    """(cluster, model id, gate on the tail node, web UI) -- a real 2-node split."""
    model_dir = tiny_models("llama")
    thread_cluster.add_node(model_dir, 0, 2, 6, "head", progress_interval=0.05, hop_timeout=600)
    tail = thread_cluster.add_node(model_dir, 3, 5, 6, "tail")
    gate = StepGate(tail)
    thread_cluster.wait_routable(model_dir.name, 2)
    webui = WebUIThread(WebUIConfig(tracker=thread_cluster.endpoint, pub=thread_cluster.tracker.pub_endpoint,
                                    port=free_port()))
    try:
        yield thread_cluster, model_dir.name, gate, webui
    finally:
        gate.open()
        webui.close()


def shot(page, name: str, **kwargs) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), **kwargs)


# --------------------------------------------------------------------------- helpers


def reply_text(page) -> str:
    return page.locator(REPLY).locator(".content").text_content()


def grow(page, gate: StepGate, before: str, max_steps: int = 30) -> str:
    """Release tail steps one at a time until the reply shows more text than ``before``.

    A step can decode to no text (part of a multi-byte character), hence the loop.
    """
    for _ in range(max_steps):
        gate.release(1)
        try:
            page.wait_for_function("([sel, n]) => document.querySelector(sel)?.textContent.length > n",
                                   arg=["#messages .msg.assistant:last-child .content", len(before)], timeout=3000)
        except sync_api.TimeoutError:
            continue
        return reply_text(page)
    raise AssertionError(f"the reply did not grow after {max_steps} steps: {before!r}")


def set_settings(page, **values) -> None:
    page.locator("#settings summary").click()
    for name, value in values.items():
        page.fill(f"#set-{name.replace('_', '-')}", str(value))


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


# --------------------------------------------------------------------------- tests


def start_chat(page, webui: WebUIThread, model: str) -> None:
    page.goto(webui.url)
    page.wait_for_function("m => document.querySelector('#model').value === m", arg=model, timeout=WAIT_MS)
    page.wait_for_selector("#topology .track[data-node=tail]", timeout=WAIT_MS)
    set_settings(page, temperature=1, top_p=1, max_tokens=400, seed=1)
    page.fill("#prompt", "the quick brown fox")
    page.press("#prompt", "Enter")


def watch_tokens_arrive(page, gate: StepGate) -> str:
    """Three releases, three longer replies, the live status; the request id on the Call wall."""
    row = page.locator("#calls-active .call.mine[data-state=running]")
    row.wait_for(timeout=WAIT_MS)  # on the wall, marked as ours, with its route, before any token
    assert re.search(r"head 0–2\s*→\s*tail 3–5", row.inner_text())
    assert page.locator("#send").inner_text() == "■"
    assert page.locator(REPLY).get_attribute("class").split() == ["msg", "assistant", "streaming"]
    texts = [""]
    for _ in range(3):
        texts.append(grow(page, gate, texts[-1]))
    assert texts[1] < texts[2] < texts[3] and all(t.startswith(texts[1]) for t in texts[2:])
    status = page.inner_text("#chat-status")
    assert re.fullmatch(r"generating… \d+ tokens? · \d+\.\d tok/s", status), status
    # stalled mid-reply, the Call wall shows the running request's live token count
    page.wait_for_function("() => Number(document.querySelector('#calls-active .call.mine .tokens')"
                           "?.textContent) > 0", timeout=WAIT_MS)
    key = row.get_attribute("data-key")
    assert key.startswith("chatcmpl-")
    return key


def stop_and_keep_partial(page, cluster, gate: StepGate, key: str) -> None:
    partial = reply_text(page)
    page.click("#send")
    page.wait_for_function("() => document.querySelector('#send').textContent === 'Send'", timeout=WAIT_MS)
    reply = page.locator(REPLY)
    assert "stopped" in reply.get_attribute("class").split() and "streaming" not in reply.get_attribute("class")
    assert reply_text(page) == partial and page.inner_text("#chat-status").startswith("stopped · ")
    # the stop cancelled the request along the route: it lands in recent completions,
    # every node frees its session, and releasing the tail brings no more text
    page.locator(f"#calls-recent tr[data-key='{key}']").filter(has_text="cancelled").wait_for(timeout=WAIT_MS)
    wait_sessions_zero([n.endpoint for n in cluster.nodes.values()], timeout=10)
    gate.open()
    shot(page, "dashboard-stopped")
    assert reply_text(page) == partial
    # a reload keeps the conversation, with the stopped reply and no cursor
    page.reload()
    page.wait_for_selector(REPLY)
    assert reply_text(page) == partial
    assert "streaming" not in page.locator(REPLY).get_attribute("class")


def non_streamed_request_on_the_wall(page, webui: WebUIThread, gate: StepGate, model: str) -> None:
    """Heads report progress for every request: a plain JSON API call shows up too."""
    gate.close()
    result: dict = {}
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hello"}]}
    caller = threading.Thread(target=lambda: result.update(post_json(f"{webui.url}/v1/chat/completions", body)))
    caller.start()
    other = page.locator("#calls-active .call[data-state=running]:not(.mine)")
    other.wait_for(timeout=WAIT_MS)
    assert "head 0–2" in other.inner_text()
    gate.open()
    caller.join(60)
    assert result["choices"][0]["finish_reason"] in ("stop", "length")
    page.locator(f"#calls-recent tr[data-key='{result['id']}']").wait_for(timeout=WAIT_MS)


def test_chat_streams_shows_on_call_wall_and_stops(browser, swarm):
    cluster, model, gate, webui = swarm
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    start_chat(page, webui, model)
    key = watch_tokens_arrive(page, gate)
    shot(page, "dashboard-streaming")
    stop_and_keep_partial(page, cluster, gate, key)
    non_streamed_request_on_the_wall(page, webui, gate, model)
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)  # let the layout settle before the picture
    shot(page, "dashboard-phone", full_page=True)
    page.close()


def _sse(*events: object) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


@pytest.fixture
def keyed_webui():
    fake = FakeClient()
    webui = WebUIThread(WebUIConfig(port=free_port(), pub=None, api_keys=frozenset({"sk-browser"})),
                        client_factory=lambda _config: fake)
    yield webui, fake
    webui.close()


def test_api_key_prompt_json_fallback_and_error_events(browser, keyed_webui):
    webui, fake = keyed_webui
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    auth: list[str | None] = []
    page.on("request", lambda r: auth.append(r.headers.get("authorization")) if "/v1/chat" in r.url else None)
    page.goto(webui.url)

    # every API call got 401: one dialog asks for the key, then the page carries on with it
    page.locator("#key-dialog[open]").wait_for(timeout=WAIT_MS)
    shot(page, "dashboard-key-dialog")
    page.fill("#key-input", "sk-browser")
    page.click("#key-save")
    page.wait_for_function("() => document.querySelector('#model').value === 'smollm2-135m'", timeout=WAIT_MS)
    assert page.evaluate("localStorage.getItem('meshnet.apiKey')") == "sk-browser"

    page.fill("#prompt", "hi")
    page.click("#send")
    page.wait_for_function("() => document.querySelector('#send').textContent === 'Send'", timeout=WAIT_MS)
    assert reply_text(page) == "Hello, world!" and auth[-1] == "Bearer sk-browser"
    assert fake.calls[-1].api_key == "sk-browser"
    json_fallback_and_error_event(page)
    page.close()


def json_fallback_and_error_event(page) -> None:
    """A JSON answer instead of SSE, then an error event mid-stream: an error bubble."""
    answer = {"id": "x", "choices": [{"message": {"role": "assistant", "content": "from json"},
                                      "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(json=answer))
    page.fill("#prompt", "json please")
    page.click("#send")
    page.wait_for_function("() => document.querySelector('#send').textContent === 'Send'", timeout=WAIT_MS)
    assert reply_text(page) == "from json"
    page.unroute("**/v1/chat/completions")
    broken = _sse({"choices": [{"delta": {"content": "half"}}]},
                  {"error": {"message": "hop b failed", "type": "server_error", "code": "hop_failed"}}, "[DONE]")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        body=broken, headers={"Content-Type": "text/event-stream"}))
    page.fill("#prompt", "break please")
    page.click("#send")
    page.locator("#messages .msg.error").filter(has_text="hop b failed").wait_for(timeout=WAIT_MS)
    assert reply_text(page) == "half"
    assert page.inner_text("#chat-status") == "error: hop b failed"
    shot(page, "dashboard-errors")


def test_topology_names_nodes_whose_weights_differ(browser, thread_cluster, tiny_models, tmp_path):
    """Two nodes claim one model id with different weights: the topology says so, not just a gap."""
    from tests.tiny_models import make_model

    ours = tiny_models("llama")
    theirs = make_model("llama", tmp_path / "elsewhere" / ours.name, seed=1)  # same id, other weights
    thread_cluster.add_node(ours, 0, 2, 6, "head")
    thread_cluster.add_node(theirs, 3, 5, 6, "tail")
    webui = WebUIThread(WebUIConfig(tracker=thread_cluster.endpoint, pub=thread_cluster.tracker.pub_endpoint,
                                    port=free_port()))
    try:
        page = browser.new_page()
        page.goto(webui.url)
        line = page.locator(f"#topology .model-block[data-model='{ours.name}'] .plan-line.differ")
        line.wait_for(timeout=WAIT_MS)
        text = line.text_content()
        assert "weights differ" in text and "head [0–2]" in text and "tail [3–5]" in text  # en dash, as the page writes ranges
        shot(page, "topology-weights-differ")
    finally:
        webui.close()


def test_topology_shows_a_fetch_from_peers_and_the_peer_it_caught(browser, thread_cluster, tiny_models):
    """A machine fetching layers reports to the tracker (FETCH_REPORT): its model block shows the
    bytes done of total and names the peer it caught sending bad bytes, whose lane turns bad."""
    from fabric import Client
    from fabric.wire import protocol as p

    model = tiny_models("llama")
    thread_cluster.add_node(model, 0, 5, 6, "whole")
    webui = WebUIThread(WebUIConfig(tracker=thread_cluster.endpoint, pub=thread_cluster.tracker.pub_endpoint,
                                    port=free_port()))
    try:
        with Client(thread_cluster.endpoint, timeout=10) as client:
            answer = client.ask(p.FetchReport("f00d", model.name, 3, 5, 3 << 20, 12 << 20, rate=1 << 20,
                                              bad_peers=("whole",), node="newcomer"))
        assert isinstance(answer, p.Ack), answer
        page = browser.new_page()
        page.goto(webui.url)
        line = page.locator(f"#topology .model-block[data-model='{model.name}'] .plan-line.fetch")
        line.wait_for(timeout=WAIT_MS)
        text = line.text_content()
        assert "newcomer layers 3–5 from peers: fetching 3.0 of 12.0 MiB (25%)" in text, text
        assert "bad bytes from whole (left out)" in text, text
        page.locator("#topology .lane-label .dot.bad").wait_for(timeout=WAIT_MS)
        page.locator("#event-log li[data-kind='fetch']").filter(has_text="whole sent bytes").wait_for(timeout=WAIT_MS)
        shot(page, "topology-fetch-from-peers")
    finally:
        webui.close()


def test_speculation_shows_on_the_call_wall_and_the_topology(browser, thread_cluster, tiny_models):
    """A request whose head drafts: the Call wall's recent row gives the share of its drafts the
    tail kept and its tokens per trip, and the model's topology block the same per route, from
    the tracker's reports (not from this page's own request)."""
    import dataclasses

    from fabric.node.speculation import SpeculationConfig

    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head", progress_interval=0.05)
    thread_cluster.add_node(model, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model.name, 2)
    head.head.config = dataclasses.replace(head.head.config, speculation=SpeculationConfig(adaptive=False))
    webui = WebUIThread(WebUIConfig(tracker=thread_cluster.endpoint, pub=thread_cluster.tracker.pub_endpoint,
                                    port=free_port()))
    try:
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(webui.url)
        page.locator("#topology .model-block").first.wait_for(timeout=WAIT_MS)
        with thread_cluster.client() as client:
            ids = [e.request_id for e in client.generate(model.name, prompt="a b c d a b c d a b c d a b",
                                                         max_tokens=24, ignore_eos=True)]
        row = page.locator(f"#calls-recent tr[data-key='{ids[0]}']")
        row.wait_for(timeout=WAIT_MS)
        kept, per_trip = row.locator("td.acceptance").text_content(), row.locator("td.per-trip").text_content()
        assert re.fullmatch(r"\d+%", kept) and float(per_trip) >= 1.0, (kept, per_trip)
        line = page.locator(f"#topology .model-block[data-model='{model.name}'] .plan-line.speculation")
        line.wait_for(timeout=WAIT_MS)
        assert "head → tail" in line.text_content() and "of drafts kept" in line.text_content()
        shot(page, "dashboard-speculation")
    finally:
        webui.close()
