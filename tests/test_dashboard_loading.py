"""The dashboard opened before any model is served: it says the model is still loading,
sends nothing, and picks the model up without a reload once nodes serve it.

Playwright for Python drives Debian's chromium, as in tests/test_dashboard_browser.py (whose
browser fixture and web UI thread this file reuses). Screenshots go to artifacts/screenshots/.
"""
from __future__ import annotations

import re

import pytest

from tests.cluster import free_port
from tests.test_dashboard_browser import WAIT_MS, WebUIThread, reply_text, shot
from webui import WebUIConfig, create_app
from webui.testing import FakeClient

LOADING = "The model is still loading"
SEND_IDLE = "() => document.querySelector('#send').textContent === 'Send'"


@pytest.fixture
def empty_swarm(thread_cluster):
    """A tracker with no nodes yet and a web UI on its live feed."""
    webui = WebUIThread(WebUIConfig(tracker=thread_cluster.endpoint, pub=thread_cluster.tracker.pub_endpoint,
                                    port=free_port()))
    try:
        yield thread_cluster, webui
    finally:
        webui.close()


class Requests:
    """The page's chat requests and the content type of each answer."""

    def __init__(self, page):
        self.sent: list[dict] = []
        self.answered: list[str] = []
        page.on("request", self._request)
        page.on("response", self._response)

    def _request(self, request) -> None:
        if request.url.endswith("/v1/chat/completions"):
            self.sent.append(request.post_data_json)

    def _response(self, response) -> None:
        if response.url.endswith("/v1/chat/completions"):
            self.answered.append(response.headers.get("content-type", ""))


def assert_loading(page, requests: Requests) -> None:
    """The chat says the model is loading, Send is off, and Enter sends nothing."""
    status = page.locator("#chat-status")
    status.filter(has_text=LOADING).wait_for(timeout=WAIT_MS)
    assert page.locator("#send").is_disabled()
    assert page.input_value("#model") == ""
    page.fill("#prompt", "are you there?")
    page.press("#prompt", "Enter")
    page.click("#send", force=True)  # a click on the disabled button does nothing either
    page.wait_for_timeout(300)
    assert requests.sent == []
    assert page.locator("#messages .msg").count() == 0
    assert "model must be" not in page.inner_text("body")
    assert LOADING in status.inner_text()
    assert page.input_value("#prompt") == "are you there?"  # kept for when the model is served


def picked(page, model: str) -> None:
    """Without a reload the picker holds the model, Send is on and the page says so."""
    page.wait_for_function("m => document.querySelector('#model').value === m", arg=model, timeout=WAIT_MS)
    assert not page.locator("#send").is_disabled()
    assert page.inner_text("#chat-status") == f"{model} is served: send a message."
    assert page.inner_text("#messages .empty-chat .lead") == "Ask the swarm something."


def send_and_stream(page, model: str, requests: Requests) -> None:
    """The prompt kept from the wait goes out and its reply streams in."""
    page.press("#prompt", "Enter")
    page.wait_for_function(SEND_IDLE, timeout=WAIT_MS)
    assert [body["model"] for body in requests.sent] == [model]
    assert requests.answered and "text/event-stream" in requests.answered[0]
    assert page.locator("#messages .msg.error").count() == 0
    assert reply_text(page)
    assert re.fullmatch(r"\d+ tokens? · \d+\.\d tok/s( · \w+)?", page.inner_text("#chat-status"))


def test_dashboard_waits_for_the_model_then_streams(browser, empty_swarm, tiny_models):
    cluster, webui = empty_swarm
    model_dir = tiny_models("llama")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    requests = Requests(page)
    page.goto(webui.url)
    assert_loading(page, requests)
    shot(page, "dashboard-model-loading")

    cluster.add_node(model_dir, 0, 2, 6, "head")  # listed by /v1/models, but half the layers: still loading
    partial = f"{model_dir.name} has nodes, but not all of its layers are served yet"
    page.locator("#chat-status").filter(has_text=partial).wait_for(timeout=WAIT_MS)
    assert_loading(page, requests)
    shot(page, "dashboard-model-partial")

    cluster.add_node(model_dir, 3, 5, 6, "tail")
    picked(page, model_dir.name)
    shot(page, "dashboard-model-picked")
    send_and_stream(page, model_dir.name, requests)
    shot(page, "dashboard-model-served")
    page.close()


@pytest.fixture
def modelless_webui():
    """A web UI without a live feed whose fabric lists no models until the test adds one."""
    fake = FakeClient(model_list=[])
    webui = WebUIThread(WebUIConfig(port=free_port(), pub=None), client_factory=lambda _config: fake)
    yield webui, fake
    webui.close()


def test_empty_model_list_and_a_failing_tracker_are_polled_until_a_model_appears(browser, modelless_webui):
    webui, fake = modelless_webui
    page = browser.new_page()
    requests = Requests(page)
    page.goto(webui.url)
    assert_loading(page, requests)

    fake.models_error = "tracker_unavailable"
    page.locator("#chat-status").filter(has_text="Models unavailable").wait_for(timeout=WAIT_MS)
    assert page.locator("#send").is_disabled()

    fake.models_error = None
    fake.model_list = [{"id": "smollm2-135m", "num_layers": 30, "nodes": 2, "routable": True}]
    picked(page, "smollm2-135m")
    send_and_stream(page, "smollm2-135m", requests)
    assert reply_text(page) == "Hello, world!"
    page.close()


@pytest.mark.asyncio
async def test_an_empty_model_is_refused_with_a_clear_message():
    client = create_app(WebUIConfig(), FakeClient(model_list=[])).test_client()
    response = await client.post("/v1/chat/completions", json={"model": "", "messages": [
        {"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["param"] == "model" and error["type"] == "invalid_request_error"
    assert "/v1/models" in error["message"], error["message"]
    listed = await (await client.get("/v1/models")).get_json()
    assert listed == {"object": "list", "data": []}
