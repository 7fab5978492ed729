"""Prometheus /metrics on the web UI, a node and the tracker."""
from __future__ import annotations

import urllib.request

import pytest

from tests.cluster import free_port
from tests.support import wait_for
from tests.test_fabric_equivalence import MESSAGES
from webui import WebUIConfig, create_app
from webui.testing import FakeClient


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in:\n{text}")


@pytest.mark.asyncio
async def test_webui_metrics_count_requests_and_tokens():
    app = create_app(WebUIConfig(pub=None), FakeClient())
    client = app.test_client()
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    response = await client.get("/metrics")
    text = (await response.get_data()).decode()
    assert response.status_code == 200 and response.content_type.startswith("text/plain")
    assert value(text, 'meshnet_webui_requests_total{model="smollm2-135m",outcome="completed"}') == 1
    assert value(text, 'meshnet_webui_tokens_total{kind="completion",model="smollm2-135m"}') > 0


def test_node_and_tracker_metrics(thread_cluster, tiny_models):
    model = tiny_models("llama")
    head = thread_cluster.add_node(model, 0, 2, 6, "head")
    tail = thread_cluster.add_node(model, 3, 5, 6, "tail")
    thread_cluster.wait_routable(model.name, 2)
    with thread_cluster.client() as client:
        list(client.generate(model.name, messages=MESSAGES, max_tokens=6))
    rows = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in tail.metrics()}
    assert rows[("node_hops_total", (("node", "tail"),))] >= 6
    assert wait_for(lambda: {s.name: s.value for s in head.metrics()}["node_sessions"] == 0, 5)
    tracker_rows = {s.name: s.value for s in thread_cluster.tracker.metrics() if not s.labels}
    assert tracker_rows["tracker_nodes"] == 2


def test_node_process_serves_metrics_port(process_cluster, tiny_models):
    model = tiny_models("llama")
    port = free_port()
    process_cluster.start_node("solo", str(model), "0-5", None, "--metrics-port", str(port))
    process_cluster.wait_nodes(["solo"], model.name)
    with process_cluster.client() as client:
        list(client.generate(model.name, messages=MESSAGES, max_tokens=4))
    text = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(text, 'meshnet_node_hops_total{node="solo"}') >= 4
    assert 'meshnet_node_kv_bytes{node="solo"}' in text
