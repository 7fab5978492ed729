"""A page of another origin calls the API in a real browser (Debian's chromium under Playwright):
it reads the answers where its origin may (this machine's loopback names, or ``--cors-origins``),
its preflight passes without the API key, and the browser keeps the answer from any other page.
The page comes from a server of its own on 127.0.0.1 (as ``localhost``) or 127.0.0.2."""
from __future__ import annotations

import http.server
import threading

import pytest

from tests.cluster import free_port
from tests.test_dashboard_browser import WebUIThread
from webui import WebUIConfig
from webui.testing import FakeClient

PAGE = b"<!doctype html><title>another origin</title><p>a front end of its own</p>"
CALL = """async ([api, key]) => {
  try {
    const r = await fetch(api + "/v1/chat/completions", {method: "POST", headers: {
      "Content-Type": "application/json", "Authorization": "Bearer " + key},
      body: JSON.stringify({model: "smollm2-135m", messages: [{role: "user", content: "hi"}], stream: true})});
    return (await r.text()).includes("[DONE]") ? "read " + r.status : "no stream";
  } catch (e) { return "blocked"; }
}"""


class PageServer:
    """One static page at http://HOST:PORT/, served from a thread."""

    def __init__(self, host: str):
        class Page(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.end_headers()
                self.wfile.write(PAGE)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Page)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pages():
    servers = {"localhost": PageServer("127.0.0.1"), "127.0.0.2": PageServer("127.0.0.2")}
    yield {name: f"http://{name}:{s.port}" for name, s in servers.items()}
    for s in servers.values():
        s.close()


def call_from(browser, page_url: str, webui: WebUIThread) -> str:
    page = browser.new_page()
    try:
        page.goto(page_url + "/")
        return page.evaluate(CALL, [webui.url, "sk-page"])
    finally:
        page.close()


@pytest.mark.parametrize("named", [False, True])
def test_a_page_of_another_origin_reads_the_api_only_where_its_origin_may(browser, pages, named):
    cors = frozenset({pages["127.0.0.2"]}) if named else frozenset()
    fake = FakeClient()
    webui = WebUIThread(WebUIConfig(port=free_port(), pub=None, api_keys=frozenset({"sk-page"}), cors_origins=cors),
                        client_factory=lambda _config: fake)
    try:
        assert call_from(browser, pages["localhost"], webui) == "read 200"
        assert call_from(browser, pages["127.0.0.2"], webui) == ("read 200" if named else "blocked")
    finally:
        webui.close()
    assert [c.api_key for c in fake.calls] == ["sk-page"] * (2 if named else 1)
