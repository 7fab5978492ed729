"""Liveness is not silence: a prompt whose prefill outlasts every timeout is answered, because
each hop reports the prefill chunks it runs (PROGRESS) and the head passes that on to its
client as progress events; the web UI and the tracker's call wall show them."""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest

from fabric import Client
from fabric.compute.compute_lock import default_path
from fabric.compute.models import load_tokenizer, resolve
from fabric.wire import protocol as p
from tests.tiny_models import reference_greedy
from tracker.events import EventRing
from tracker.planner import CostModel
from tracker.registry import Registry
from tracker.reports import Reports
from tracker.stats import StatsStore
from webui import WebUIConfig, create_app
from webui.board import CallBoard
from webui.testing import FakeClient, Script

SENTENCE = "the quick brown fox jumps over the lazy dog. meshnet splits a model across nodes."
LONG = [{"role": "user", "content": " ".join([SENTENCE] * 80)}]  # ~2,500 tokens
CLIENT_TIMEOUT = 2.0  # the client gives up on a head that sends no event for this long
HOP_TIMEOUT = 2.0  # the head re-sends a step that hears nothing for this long


class Throttle:
    """Slows every node of one machine: holds their shared compute lock ``hold`` seconds, lets
    go for ``gap`` seconds, again and again. Each hold is shorter than every timeout; the
    prefill they add up to is several times longer."""

    def __init__(self, path: str, hold: float = 0.9, gap: float = 0.002):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.hold, self.gap = hold, gap
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            self.stop.wait(self.hold)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            time.sleep(self.gap)

    def __enter__(self) -> Throttle:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)
        os.close(self.fd)


def test_a_prompt_whose_prefill_outlasts_every_timeout_is_answered(process_cluster, tiny_models):
    model = tiny_models("llama")
    ids = list(load_tokenizer(resolve(str(model))).apply_chat_template(LONG, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False))
    expected = reference_greedy(model, ids, 4)
    process_cluster.start_node("a", str(model), "0-2", None, "--hop-timeout", str(HOP_TIMEOUT))
    process_cluster.start_node("b", str(model), "3-5")
    process_cluster.wait_nodes(["a", "b"], model.name)
    lock = default_path("cpu", {"XDG_RUNTIME_DIR": str(process_cluster.runtime_dir)})
    events, times = [], []
    with Client(process_cluster.endpoint, timeout=CLIENT_TIMEOUT) as client, Throttle(str(lock)) as throttle:
        for event in client.generate(model.name, messages=LONG, max_tokens=4):
            events.append(event)
            times.append(time.monotonic())
            if event.event == p.EventKind.TOKEN:
                throttle.stop.set()  # the prompt is in: decode at full speed
    kinds = [e.event for e in events]
    assert [t for e in events for t in e.token_ids] == expected, process_cluster.logs()
    first_token = kinds.index(p.EventKind.TOKEN)
    progress = [e for e in events if e.event == p.EventKind.PROGRESS]
    assert kinds[0] == p.EventKind.START and set(kinds[1:first_token]) == {p.EventKind.PROGRESS}
    assert len(progress) >= 4
    assert all(e.prefill_tokens == len(ids) and e.text == "" and not e.token_ids for e in progress)
    done = [e.prefilled for e in progress]
    assert done == sorted(set(done)) and 0 < done[0] and done[-1] <= len(ids)
    # the prefill took longer than either timeout allows a silence to last
    assert times[first_token] - times[0] > 2 * max(CLIENT_TIMEOUT, HOP_TIMEOUT), process_cluster.logs()
    assert "re-prefilling" not in process_cluster.logs()  # the head never took the moving step for lost


@pytest.mark.asyncio
async def test_the_web_ui_streams_progress_as_comments_openai_clients_skip():
    fake = FakeClient(script=Script(prefill=(3, 5)))
    client = create_app(WebUIConfig(), fake).test_client()
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    raw = (await response.get_data()).decode()
    blocks = [b for b in raw.split("\n\n") if b]
    comments = [b for b in blocks if b.startswith(":")]
    assert comments == [': progress {"prefilled":3,"prefill_tokens":7}', ': progress {"prefilled":5,"prefill_tokens":7}']
    data = [json.loads(b.removeprefix("data: ")) for b in blocks if b.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in data) == "Hello, world!"
    whole = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert (await whole.get_json())["choices"][0]["message"]["content"] == "Hello, world!"


def test_the_call_wall_shows_a_prompt_prefilling():
    published: list[dict] = []
    reports = Reports(Registry(), StatsStore(), EventRing(), CostModel(), published.append)

    def report(**fields) -> None:
        assert isinstance(reports.handle(p.Report(request_id="r1", node_id="a", model="m", prompt_tokens=3200,
                                                  **fields), ledger=None), p.Ack)

    report(elapsed=0.0)  # the head's first report: connected
    report(elapsed=4.0, prefilled=1536, prefill_tokens=3200)
    assert published[-1]["kind"] == "progress" and published[-1]["message"] == "prefill 1536 / 3200 tokens"
    assert (published[-1]["prefilled"], published[-1]["prefill_tokens"], published[-1]["tokens"]) == (1536, 3200, 0)
    board = CallBoard()
    for event in published:
        row = board.apply(event, now=1.0)
    assert (row["prefilled"], row["prefill_tokens"], row["tokens"]) == (1536, 3200, 0)
    report(elapsed=9.0, completion_tokens=3)  # decoding: no prefill runs
    assert published[-1]["message"].startswith("3 tokens") and published[-1]["prefill_tokens"] == 0
