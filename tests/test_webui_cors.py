"""Cross-origin calls to the API: the headers a browser needs to let a page of another origin
read /v1's answers, given to pages of this machine's loopback names and of ``--cors-origins``
only, and a preflight answered without the API key (tests/test_dashboard_browser.py: the same
in a real browser)."""
from __future__ import annotations

import argparse

import pytest

from fabric.flags import origins
from webui import WebUIConfig, create_app
from webui.testing import FakeClient

pytestmark = pytest.mark.asyncio

CHAT = "/v1/chat/completions"
BODY = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def client_of(**config):
    return create_app(WebUIConfig(pub=None, **config), FakeClient()).test_client()


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173", "https://localhost",
                                    "http://[::1]:8080"])
async def test_a_page_of_this_machine_may_read_the_api(origin):
    client = client_of(api_keys=frozenset({"sk-1"}))
    pre = await client.options(CHAT, headers={"Origin": origin, **PREFLIGHT})
    assert pre.status_code < 300  # answered without the key a preflight never carries
    assert pre.headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    post = await client.post(CHAT, json=BODY, headers={"Origin": origin, "Authorization": "Bearer sk-1"})
    assert post.status_code == 200 and post.headers["Access-Control-Allow-Origin"] == origin
    assert "Origin" in post.headers["Vary"]
    refused = await client.post(CHAT, json=BODY, headers={"Origin": origin})
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == origin  # readable
    stream = await client.post(CHAT, json={**BODY, "stream": True},
                               headers={"Origin": origin, "Authorization": "Bearer sk-1"})
    assert stream.headers["Access-Control-Allow-Origin"] == origin and b"[DONE]" in await stream.get_data()


@pytest.mark.parametrize("origin", ["http://192.168.1.20:3000", "http://evil.example", "null", "http://127.0.0.2:80",
                                    "http://localhost.evil.example", "ftp://localhost"])
async def test_a_page_of_another_origin_gets_no_cors_headers(origin):
    client = client_of(api_keys=frozenset({"sk-1"}))
    pre = await client.options(CHAT, headers={"Origin": origin, **PREFLIGHT})
    post = await client.post(CHAT, json=BODY, headers={"Origin": origin, "Authorization": "Bearer sk-1"})
    assert "Access-Control-Allow-Origin" not in pre.headers and "Access-Control-Allow-Origin" not in post.headers


async def test_named_origins_and_any_origin():
    named = client_of(cors_origins=origins("http://192.168.1.20:3000, https://chat.example/"))
    for origin, ok in [("http://192.168.1.20:3000", True), ("https://chat.example", True),
                       ("http://192.168.1.20:3001", False), ("http://localhost:3000", True)]:
        got = await named.get("/v1/models", headers={"Origin": origin})
        assert ("Access-Control-Allow-Origin" in got.headers) == ok, origin
    anyone = client_of(cors_origins=origins("*"))
    got = await anyone.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert got.headers["Access-Control-Allow-Origin"] == "http://evil.example"


async def test_the_dashboard_s_own_paths_and_requests_without_an_origin_get_none():
    client = client_of()
    assert "Access-Control-Allow-Origin" not in (await client.get("/v1/models")).headers
    assert "Access-Control-Allow-Origin" not in (await client.get("/api/status", headers={
        "Origin": "http://localhost:3000"})).headers


async def test_meshnet_up_hands_its_origins_and_api_keys_to_the_web_ui():
    from fabric.cli import build_parser
    from fabric.cli.up_command import webui_command

    parser = build_parser()
    up = parser.parse_args(["up", "--cors-origins", "http://192.168.1.20:3000,https://chat.example"])
    argv = webui_command(up, [], [])
    assert parser.parse_args(argv).cors_origins == up.cors_origins == {"http://192.168.1.20:3000",
                                                                       "https://chat.example"}
    assert "--cors-origins" not in webui_command(parser.parse_args(["up"]), [], [])
    keyed = parser.parse_args(["up", "--api-keys", "/etc/keys.txt"])
    assert parser.parse_args(webui_command(keyed, [], [])).api_keys == "/etc/keys.txt"


@pytest.mark.parametrize("text", ["ftp://x", "http://a:99999", "http://a/path", "localhost:3000", ",", "http://"])
async def test_a_flag_that_names_no_origin_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        origins(text)
