"""Liveness is not silence: a prompt whose prefill outlasts every timeout is answered, because
each hop reports the prefill chunks it runs (PROGRESS) and the head passes that on to its
client as progress events; the web UI and the tracker's call wall show them."""
from __future__ import annotations

import fcntl
import io
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
OTHER = [{"role": "user", "content": " ".join(["hello world, how are you today? the lazy dog sleeps."] * 80)}]
CLIENT_TIMEOUT = 2.0  # the client gives up on a head that sends no event for this long
HOP_TIMEOUT = 2.0  # the head re-sends a step that hears nothing for this long


class Throttle:
    """Slows every node of one machine: holds their shared compute lock ``hold`` seconds, lets
    go for ``gap`` seconds, again and again. A node runs a slice only between holds, each hold
    is shorter than every timeout, and the prefill they add up to is several times longer."""

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


def _stream(tracker: str, model: str, messages: list[dict], run: list, started: threading.Event,
            first_token: threading.Event) -> None:
    """One request with a client that gives up after CLIENT_TIMEOUT seconds without an event:
    (arrival time, event) pairs into ``run``, or the exception that ended it. ``started`` is
    set once the head has taken the request (its start event) or the request has ended;
    ``first_token`` once a token came or the request ended."""
    try:
        with Client(tracker, timeout=CLIENT_TIMEOUT) as client:
            for event in client.generate(model, messages=messages, max_tokens=4):
                run.append((time.monotonic(), event))
                started.set()
                if event.event == p.EventKind.TOKEN:
                    first_token.set()
    except Exception as exc:  # re-raised by the test
        run.append((time.monotonic(), exc))
    started.set()
    first_token.set()


def _check(run: list, expected: list[int], prompt_tokens: int, logs: str) -> None:
    """The answer equals the reference; progress (and only progress) came before the first
    token, for longer than any timeout lets a silence last."""
    times, events = [t for t, _ in run], [e for _, e in run]
    timeline = [(round(t - times[0], 2), getattr(e, "event", e), getattr(e, "prefilled", None)) for t, e in run]
    assert not [e for e in events if isinstance(e, Exception)], (timeline, logs)
    kinds = [e.event for e in events]
    assert [t for e in events for t in e.token_ids] == expected, logs
    first = kinds.index(p.EventKind.TOKEN)
    assert kinds[0] == p.EventKind.START and set(kinds[1:first]) == {p.EventKind.PROGRESS}
    progress = events[1:first]
    assert len(progress) >= 4
    assert all(e.prefill_tokens == prompt_tokens and e.text == "" and not e.token_ids for e in progress)
    done = [e.prefilled for e in progress]
    assert done == sorted(done) and 0 < done[-1] <= prompt_tokens
    assert times[first] - times[0] > 2 * max(CLIENT_TIMEOUT, HOP_TIMEOUT), logs


def test_prompts_whose_prefill_outlasts_every_timeout_are_answered(process_cluster, tiny_models):
    """Two long prompts at once on two node processes that their shared compute lock slows
    down (the ``Throttle``, until the first prompt's first token): the first prefills while the
    second waits its turn at the head. Each hop's PROGRESS
    (it ran a chunk, or the step waits in its queue) keeps both clients, and the head's step
    timeout, from taking them for lost; both answers equal transformers'."""
    model = tiny_models("llama")
    tokenizer = load_tokenizer(resolve(str(model)))
    prompts = [LONG, OTHER]
    ids = [list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
           for m in prompts]
    expected = [reference_greedy(model, i, 4) for i in ids]
    process_cluster.start_node("a", str(model), "0-2", None, "--hop-timeout", str(HOP_TIMEOUT))
    process_cluster.start_node("b", str(model), "3-5")
    process_cluster.wait_nodes(["a", "b"], model.name)
    lock = default_path("cpu", {"XDG_RUNTIME_DIR": str(process_cluster.runtime_dir)})  # the nodes' default
    runs = [[], []]
    starts, firsts = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    with Throttle(str(lock)) as throttle:
        threads = [threading.Thread(target=_stream, args=(process_cluster.endpoint, model.name, *args))
                   for args in zip(prompts, runs, starts, firsts)]
        for thread, started in zip(threads, starts):
            thread.start()
            assert started.wait(120), "the head never took the request"  # the first reaches the head first
        assert firsts[0].wait(120), "the first prompt got no token"
        throttle.stop.set()  # the first prompt is in: the rest runs at full speed
        for thread in threads:
            thread.join(120)
            assert not thread.is_alive(), "a request did not end"
    logs = process_cluster.logs()
    for run, want, n in zip(runs, expected, ids):
        _check(run, want, len(n), logs)
    assert "re-prefilling" not in logs  # the head never took a moving or waiting step for lost


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


def test_meshnet_chat_writes_only_the_reply_while_a_prompt_prefills():
    from fabric.chat_repl import ChatConfig, Reply

    events = [p.Event("r", "start", prompt_tokens=9), p.Event("r", "progress", prefilled=4, prefill_tokens=9),
              p.Event("r", "token", text="Hi", token_ids=(5,)), p.Event("r", "done", finish_reason="stop")]

    class Fabric:
        def generate(self, model: str, **request):
            yield from events

    out = io.StringIO()
    config = ChatConfig("tcp://127.0.0.1:1", None, "m", None, 8, p.Sampling(), ())
    assert Reply(out).stream(Fabric(), config, [{"role": "user", "content": "x"}]) == "Hi" == out.getvalue()
