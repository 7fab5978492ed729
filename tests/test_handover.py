"""A request goes on when its head dies (issue 17, item 1).

The client sends the request to another head with the token ids it has received
(``GENERATE.resume``) and the seed the first head used; the new head takes them as its own
and goes on, so the caller sees one stream with the text an unbroken run gives. Units
first (the route session's priming, the client's continuation, the tracker's handover
event), then real processes: the head serving a stream killed with SIGKILL mid-stream.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import urllib.request

import pytest

from fabric import Client, FabricError
from fabric.client.core import GenerateArgs, HeadDied
from fabric.client.stream import MAX_HANDOVERS, Continuation, RequestStream
from fabric.node.route_session import RouteSession
from fabric.wire import protocol as p
from tests.cluster import ROOT, wait_sessions_zero
from tests.support import wait_for
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.test_protocol import _doc_block
from tests.test_route_session import LocalTransport
from tests.tiny_models import reference_greedy
from tracker.events import EventRing
from tracker.ledger import Ledger
from tracker.planner import CostModel
from tracker.registry import Registry
from tracker.reports import Reports
from tracker.stats import StatsStore
from webui.board import CallBoard

PROMPT = "the quick brown fox"
HOT = p.Sampling(temperature=1.5, top_k=8)  # sampled: a token depends on (seed, position)


# --------------------------------------------------------------------------- the new head's session


def _session(split, *, resume=(), sampling=p.Sampling(), drawn=7, max_tokens=16, stop=(), eos=frozenset()):
    """A route session over the in-process split; ``drawn`` is the seed its head would draw."""
    _, executors, tok, route = split
    request = p.Generate(request_id="r1", route=route, prompt=PROMPT, max_tokens=max_tokens, stop=stop,
                         sampling=sampling, resume=tuple(resume))
    transport = LocalTransport(executors)
    rs = RouteSession(request, tok(PROMPT)["input_ids"], tokenizer=tok, eos=eos, reply_to="inproc://h",
                      transport=transport, seed=drawn, session=request.request_id)
    return rs, transport


def _drive(rs, transport) -> list[p.Event]:
    events = rs.start()
    while transport.replies and not rs.finished:
        events += rs.on_token(transport.replies.pop(0))
    return events


def _tokens(events) -> list[int]:
    return [t for e in events if e.event == "token" for t in e.token_ids]


def _text(events) -> str:
    return "".join(e.text for e in events if e.event == "token")


def _after(events, k: int) -> str:
    """The text of ``events`` after the event of the k-th token (the client had up to there)."""
    seen, parts = 0, []
    for e in (e for e in events if e.event == "token"):
        if seen >= k:
            parts.append(e.text)
        seen += len(e.token_ids)
    return "".join(parts)


@pytest.mark.parametrize("sampling", [p.Sampling(), HOT], ids=["greedy", "unseeded sampling"])
def test_a_session_that_resumes_goes_on_as_the_unbroken_one(split, sampling):
    """Greedy, and sampled with the seed the first head drew (its start event names it): the
    resumed session sends the tokens and text the unbroken one sent after the k-th token,
    holds back a stop string's start as it did, and counts usage as it did."""
    whole, _ = _session(split, sampling=sampling, drawn=12345)
    unbroken = _drive(whole, _)
    ids, prompt_tokens = _tokens(unbroken), whole.prompt_tokens
    assert unbroken[0].seed == 12345 and len(ids) == 16
    stop = (_after(unbroken, 0)[:6][-1] + "\x00",)  # a stop string whose first character comes early: held back
    whole, transport = _session(split, sampling=sampling, drawn=12345, stop=stop)
    unbroken = _drive(whole, transport)
    assert _tokens(unbroken) == ids
    for k in (1, 6, 15):
        again = dataclasses.replace(sampling, seed=unbroken[0].seed)
        rs, transport = _session(split, resume=ids[:k], sampling=again, drawn=999, stop=stop)
        events = _drive(rs, transport)
        assert [e.event for e in events[:2]] == ["start", "token"]
        assert transport.sent[0].pos == 0 and rs.history[:prompt_tokens + k] == [*rs.history[:prompt_tokens],
                                                                                  *ids[:k]]
        assert _tokens(events) == ids[k:], k
        assert "".join(e.text for e in events if e.event == "token") == _after(unbroken, k), k
        done = events[-1]
        assert (done.event, done.finish_reason) == ("done", "length")
        assert (done.prompt_tokens, done.completion_tokens) == (prompt_tokens, 16)
        assert [m.pos for m in transport.sent[1:]] == list(range(prompt_tokens + k, prompt_tokens + 15))
    if sampling.temperature:
        other, _ = _session(split, sampling=sampling, drawn=999)
        assert _tokens(_drive(other, _)) != ids  # without the first head's seed it would not go on the same


def test_a_resume_that_already_ends_the_reply_ends_it_at_once(split):
    """The first head died between the last token and its done: the new head sends only the
    end (after a last flush of held-back text) and nothing along the route."""
    whole, t = _session(split)
    unbroken = _drive(whole, t)
    ids = _tokens(unbroken)
    rs, transport = _session(split, resume=ids)
    events = rs.start()
    assert [e.event for e in events] == ["start", *(["token"] if unbroken[-2].token_ids == () else []), "done"]
    assert events[-1].finish_reason == "length" and not transport.sent
    eos = frozenset({ids[3]})
    first = ids.index(ids[3])
    rs, transport = _session(split, resume=ids[:first + 1], eos=eos)
    events = rs.start()
    assert [(e.event, e.finish_reason) for e in events] == [("start", None), ("done", "stop")]
    assert events[-1].completion_tokens == first + 1 and not transport.sent
    rs, transport = _session(split, resume=ids[:first + 3], eos=eos)
    events = rs.start()
    assert [(e.event, e.error_code) for e in events] == [("start", None), ("error", p.ErrorCode.BAD_REQUEST)]
    assert not transport.sent


@pytest.mark.parametrize("resume,max_tokens", [((1,) * 9, 8), ((-1,), 8), ((1 << 31,), 8)])
def test_the_wire_refuses_a_resume_beyond_max_tokens_or_token_ids(resume, max_tokens):
    msg = p.Generate(request_id="r", route=(p.Hop("a", "tcp://h:1", 0, 5),), prompt="x", max_tokens=max_tokens,
                     resume=resume)
    with pytest.raises(p.ProtocolError, match="resume") as info:
        p.decode(p.encode(msg))
    assert info.value.code == p.ErrorCode.BAD_REQUEST


# --------------------------------------------------------------------------- the client's continuation

A1, A2, A3, A4 = (p.Hop(f"a{i}", f"tcp://127.0.0.1:700{i}", 0, 5) for i in range(1, 5))


def _generate(**kw) -> p.Generate:
    return p.Generate(request_id="r1", route=(A1,), prompt="x", max_tokens=16, **kw)


def test_the_caller_sees_one_start_each_token_once_and_the_seed_goes_on():
    stream = Continuation(_generate(sampling=HOT), fixed_route=False)
    start = p.Event("r1", "start", route=(A1,), seed=41)
    assert stream.passes(start) and stream.msg.sampling.seed == 41
    for t in (5, 6, 7):
        assert stream.passes(p.Event("r1", "token", text=chr(t), token_ids=(t,)))
    assert stream.around(HeadDied(A1)) == [("a1",)]
    stream.go_on(HeadDied(A1), (A2,))
    assert stream.msg.route == (A2,) and stream.msg.resume == (5, 6, 7) and stream.msg.sampling == \
        dataclasses.replace(HOT, seed=41)
    assert not stream.passes(dataclasses.replace(start, route=(A2,), seed=41))  # the new head's start
    assert stream.passes(p.Event("r1", "token", text="h", token_ids=(8,)))
    assert stream.passes(p.Event("r1", "token", text="tail"))  # a last flush, once
    stream.go_on(HeadDied(A2), (A3,))  # the head died before its done: the next one flushes again
    assert stream.msg.resume == (5, 6, 7, 8)
    assert not stream.passes(p.Event("r1", "token", text="tail"))
    assert stream.passes(p.Event("r1", "done", finish_reason="length", completion_tokens=4))


def test_a_request_stops_going_on_after_too_many_heads_or_on_a_route_the_caller_chose():
    chosen = Continuation(_generate(), fixed_route=True)
    died = HeadDied(A1)
    with pytest.raises(HeadDied) as info:
        chosen.around(died)
    assert info.value is died
    stream = Continuation(_generate(), fixed_route=False)
    heads = [A1, A2, A3, A4]
    for n, head in enumerate(heads[:MAX_HANDOVERS], 1):
        assert stream.around(HeadDied(head))[0] == tuple(h.node for h in heads[:n])
    with pytest.raises(HeadDied):
        stream.around(HeadDied(heads[MAX_HANDOVERS]))


def test_a_head_lost_earlier_is_taken_again_when_no_other_serves(monkeypatch):
    """A request that left a1 for a2 and then loses a2 goes back to a1 if the tracker knows
    nothing else: a1 was restarted meanwhile (under its name, at a new endpoint)."""
    stream = Continuation(_generate(), fixed_route=False)
    assert stream.around(HeadDied(A1)) == [("a1",)]
    stream.go_on(HeadDied(A1), (A2,))
    back = p.Hop("a1", "tcp://127.0.0.1:9", 0, 5)

    def route(model, exclude=()):  # the tracker's answer as the client's program, with no I/O
        if "a1" in exclude:
            raise FabricError(p.ErrorCode.NO_ROUTE, "layers 0-5 are not served; skipped a1 (excluded)")
        return (back,)
        yield

    with Client("tcp://127.0.0.1:1") as client:
        request = RequestStream(client, GenerateArgs.of("m", prompt="x"), None)
        request.stream = stream
        monkeypatch.setattr(client, "_route_program", route)
        assert client._run(request._route_around(HeadDied(A2))) == (back,)
        monkeypatch.setattr(client, "_route_program", lambda model, exclude=(): route(model, ("a1",)))
        with pytest.raises(HeadDied, match="no other head could take the request over"):
            client._run(request._route_around(HeadDied(back)))


# --------------------------------------------------------------------------- the tracker and the dashboard


def _report(node: str, **kw) -> p.Report:
    route = (p.Hop(node, f"tcp://127.0.0.1:1{node[-1]}", 0, 2), p.Hop("t", "tcp://127.0.0.1:19", 3, 5))
    return p.Report(request_id="r1", node_id=node, model="m", route=route, prompt_tokens=10, max_tokens=40, **kw)


def _reports() -> tuple[Reports, list[dict]]:
    """The tracker's reports part, with the nodes of ``_report``'s routes registered (statistics
    learn only from routes of registered nodes)."""
    published: list[dict] = []
    registry = Registry()
    for node, endpoint, start, end in (("a1", "tcp://127.0.0.1:11", 0, 2), ("a2", "tcp://127.0.0.1:12", 0, 2),
                                       ("t", "tcp://127.0.0.1:19", 3, 5)):
        registry.register(p.Register(node, endpoint, "m", "fp", 6, start, end))
    return Reports(registry, StatsStore(), EventRing(), CostModel(), published.append), published


def test_the_tracker_publishes_a_handover_and_bills_the_request_once():
    reports, published = _reports()
    ledger = Ledger(":memory:")
    for report in (_report("a1", completion_tokens=0, elapsed=0.01), _report("a1", completion_tokens=12, elapsed=0.6),
                   _report("a2", completion_tokens=12, resumed=12, elapsed=0.01),
                   _report("a2", completion_tokens=30, resumed=12, elapsed=0.5)):
        reports.handle(report, ledger)
    final = _report("a2", completion_tokens=40, resumed=12, elapsed=0.8, final=True, finish_reason="length")
    assert reports.handle(final, ledger).detail == "billed"
    assert reports.handle(final, ledger).detail == "already recorded: billed"
    assert [e["kind"] for e in published if e["kind"] != "progress"] == ["connected", "handover", "complete"]
    handover = next(e for e in published if e["kind"] == "handover")
    assert (handover["node"], handover["previous"], handover["resumed"]) == ("a2", "a1", 12)
    documented = json.loads(_doc_block("# events handover"))
    assert sorted(handover) == sorted(documented)
    rows = ledger._db.execute("SELECT request_id, head_node, prompt_tokens, completion_tokens, status "
                              "FROM completions").fetchall()
    assert rows == [("r1", "a2", 10, 40, "billed")]
    counts = reports.stats.snapshot()["counts"]
    assert (counts["completions"], counts["fed"]) == (1, 1)  # 28 tokens of its own: the last head's rate
    with pytest.raises(p.ProtocolError, match="resumed"):
        reports.handle(_report("a3", completion_tokens=3, resumed=4, final=True), ledger)


def test_a_handover_the_tracker_hears_first_in_a_final_report_is_published_too():
    reports, published = _reports()
    final = _report("a2", completion_tokens=12, resumed=12, elapsed=0.1, final=True, finish_reason="stop")
    reports.handle(final, Ledger(":memory:"))
    assert [(e["kind"], e.get("previous")) for e in published] == [("handover", None), ("complete", None)]


def test_the_call_wall_moves_a_request_to_the_head_that_took_it_over():
    board = CallBoard()
    board.apply({"kind": "connected", "key": "r1", "seq": 1, "node": "a1", "model": "m",
                 "hops": [{"node": "a1", "start_layer": 0, "end_layer": 2}]}, 0.0)
    row = board.apply({"kind": "handover", "key": "r1", "seq": 2, "node": "a2", "model": "m",
                       "message": "a2 took over", "hops": [{"node": "a2", "start_layer": 0, "end_layer": 2}]}, 1.0)
    assert (row["node"], row["state"], [h["node"] for h in row["hops"]]) == ("a2", "running", ["a2"])


# --------------------------------------------------------------------------- real processes

TOKENS = 150  # more than the reference's reply: it ends at its end-of-sequence token
LINK_DELAY = 0.02  # seconds each way on the link to a tail: a token takes this long at least


def _swarm(cluster, model) -> list[str]:
    """Two heads (0-2) and two tails (3-5) behind a delay proxy, so that a stream lasts long
    enough to be killed in its middle; the token ids of the unbroken reply."""
    from tests.support import free_port

    maps, tails = [], []
    for name in ("t1", "t2"):
        bind, front = free_port(), free_port()
        maps += ["--map", f"127.0.0.1:{front}=127.0.0.1:{bind}"]
        tails.append((name, bind, f"tcp://127.0.0.1:{front}"))
    log = open(cluster.tmp / "proxy.log", "ab")
    cluster.procs["proxy"] = subprocess.Popen([sys.executable, "-m", "tests.delay_proxy", *maps, "--delay",
                                               str(LINK_DELAY)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    for name, bind, front in tails:
        cluster.start_node(name, str(model), "3-5", bind, "--advertise", front)
    for name in ("h1", "h2"):
        cluster.start_node(name, str(model), "0-2")
    cluster.wait_nodes(["h1", "h2", "t1", "t2"], model.name)
    return reference_greedy(model, prompt_ids(model), TOKENS)


def _restart(cluster, model, name: str) -> None:
    """Start the head ``name`` again, on a new port, and wait until the tracker plans on it."""
    endpoint = cluster.start_node(name, str(model), "0-2")

    def registered() -> bool:
        with cluster.client() as client:
            return any(n["id"] == name and n["endpoint"] == endpoint for n in client.status()["nodes"])
    assert wait_for(registered, 60, 0.2), cluster.logs()


def _stream_and_kill_the_head(cluster, model: str, after: int = 4, **kw) -> tuple[list[p.Event], str]:
    """Stream a chat; after ``after`` tokens kill -9 its head. The events, and the head killed."""
    events, victim = [], ""
    with cluster.client() as client:
        for event in client.generate(model, messages=MESSAGES, **{"max_tokens": TOKENS, **kw}):
            events.append(event)
            victim = victim or event.route[0].node
            if len(_tokens(events)) == after and victim in cluster.procs:
                cluster.kill(victim, signal.SIGKILL)
    return events, victim


def _handovers(cluster) -> dict[str, dict]:
    with cluster.client() as client:
        return {e["key"]: e for e in client.status()["events"] if e["kind"] == "handover"}


def _ledger(cluster, ids: list[str]) -> list[tuple]:
    """The ledger's rows of ``ids``, once the tracker has them all."""
    def rows() -> list[tuple]:
        with sqlite3.connect(cluster.tmp / "ledger.sqlite3") as db:
            marks = ",".join("?" * len(ids))
            return db.execute(f"SELECT request_id, prompt_tokens, completion_tokens, status FROM completions "
                              f"WHERE request_id IN ({marks}) ORDER BY request_id", ids).fetchall()
    assert wait_for(lambda: len(rows()) == len(ids), 20), rows()
    return rows()


def test_kill_9_of_the_head_mid_stream_costs_the_stream_nothing(process_cluster, tiny_models):
    """fabric.Client, greedy and with sampling the caller gave no seed for: one start, no
    error, the text of the unbroken reply; the ledger bills each request once, in full."""
    cluster, model = process_cluster, tiny_models("llama")
    expected = _swarm(cluster, model)
    with cluster.client() as client:
        unbroken = list(client.generate(model.name, messages=MESSAGES, max_tokens=TOKENS))
    assert _tokens(unbroken) == expected
    events, victim = _stream_and_kill_the_head(cluster, model.name, request_id="greedy")
    assert [e.event for e in events].count("start") == 1 and events[-1].event == "done", events[-1]
    assert (_tokens(events), _text(events)) == (expected, _text(unbroken))
    assert victim not in cluster.procs and events[-1].route[0].node != victim  # it went on at the other head
    assert (events[-1].prompt_tokens, events[-1].completion_tokens) == (unbroken[-1].prompt_tokens, len(expected))
    # no hop of the dead head's route keeps the session: each freed it when its link to the head went down
    wait_sessions_zero([cluster.node_endpoints[n] for n in ("h1", "h2", "t1", "t2") if n in cluster.procs], timeout=5)
    _restart(cluster, model, victim)
    hot = dict(temperature=0.7, top_k=2, ignore_eos=True)  # no seed: the first head draws one
    sampled, victim = _stream_and_kill_the_head(cluster, model.name, request_id="sampled", **{**hot, "max_tokens": 40})
    with cluster.client() as client:
        again = list(client.generate(model.name, messages=MESSAGES, max_tokens=40, seed=sampled[0].seed, **hot))
    assert (_tokens(sampled), _text(sampled)) == (_tokens(again), _text(again)) and len(_tokens(again)) == 40
    assert sampled[-1].route[0].node != victim
    handovers = _handovers(cluster)
    assert all(handovers[rid]["resumed"] >= 4 for rid in ("greedy", "sampled")), handovers
    prompt = unbroken[-1].prompt_tokens
    assert _ledger(cluster, ["greedy", "sampled"]) == [("greedy", prompt, len(expected), "billed"),
                                                       ("sampled", prompt, 40, "billed")]


def _post(url: str, body: dict, on_chunk=None) -> tuple[str, list[dict], str]:
    """POST a chat to the web UI: its text, its SSE chunks ([] when not streamed), its request id.
    ``on_chunk(chunks)`` is called after each SSE chunk."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        rid = r.headers["X-Request-Id"]
        if not body.get("stream"):
            return json.loads(r.read())["choices"][0]["message"]["content"], [], rid
        chunks = []
        for line in r:  # each line as it arrives
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
                if on_chunk:
                    on_chunk(chunks)
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")), chunks, rid


def _known_events(cluster) -> set[str]:
    with cluster.client() as client:
        return {e["key"] for e in client.status()["events"]}


def _kill_when_tokens_come(cluster, known: set[str], killed: list[str]) -> bool:
    """Wait for a new request's progress report with tokens (its head's), then kill -9 that head,
    unless one was killed already. By the report, not by which head holds sessions: another head
    may still hold an earlier request's kept ones."""
    if killed:
        return True
    def progress() -> dict | None:
        with cluster.client() as client:
            return next((e for e in client.status()["events"] if e["kind"] == "progress" and e["key"] not in known
                         and e["tokens"] >= 2), None)
    assert wait_for(lambda: progress() is not None, 30, 0.02)
    head = progress()["node"]
    cluster.kill(head, signal.SIGKILL)
    killed.append(head)
    return True


def test_kill_9_of_the_head_mid_stream_under_the_web_ui_and_meshnet_chat(process_cluster, tiny_models):
    """The web UI's stream and non-streamed reply, and `meshnet chat`'s, each with the head that
    serves it killed mid-stream: the unbroken text, no error, each request billed once."""
    cluster, model = process_cluster, tiny_models("llama")
    _swarm(cluster, model)
    url = cluster.start_webui()
    body = {"model": model.name, "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0}
    text, _, first = _post(url, {**body, "stream": True})
    streamed: list[str] = []
    known = _known_events(cluster)
    got, chunks, rid = _post(url, {**body, "stream": True},
                             lambda chunks: _content(chunks) >= 3 and _kill_when_tokens_come(cluster, known, streamed))
    assert got == text and streamed, streamed
    assert not any("error" in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    ids = [first, rid]
    _restart(cluster, model, streamed[0])
    # the non-streamed reply runs long (past end-of-sequence), so the head is still serving it
    # when the killer acts; a reply that ended first had no handover to book
    long_body = {**body, "max_tokens": 4 * TOKENS, "ignore_eos": True}
    long_text, _, _ = _post(url, long_body)
    known = _known_events(cluster)
    whole: list[str] = []
    killer = threading.Thread(target=_kill_when_tokens_come, args=(cluster, known, whole))
    killer.start()
    got, _, rid = _post(url, long_body)
    killer.join(30)
    assert got == long_text and whole
    ids.append(rid)
    _restart(cluster, model, whole[0])
    assert _chat(cluster, model.name) == text + "\n"
    handovers = _handovers(cluster)
    assert set(ids[1:]) <= set(handovers) and len(handovers) == 3, handovers  # the chat's, too
    assert all(h["resumed"] > 0 for h in handovers.values()), handovers  # each head died mid-stream
    billed = sorted((r[2], r[3]) for r in _ledger(cluster, ids))  # each once; the long reply its whole length
    assert billed == [(billed[0][0], "billed")] * 2 + [(4 * TOKENS, "billed")] and billed[0][0] < 4 * TOKENS, billed


def _content(chunks: list[dict]) -> int:
    return sum(1 for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content"))


def _chat(cluster, model: str) -> str:
    """`meshnet chat PROMPT`, its head killed -9 once its reply shows: what it printed. The
    head is the one whose progress report names the chat's request (another head may still hold
    an earlier request's kept sessions)."""
    known = _known_events(cluster)
    proc = subprocess.Popen([sys.executable, "-m", "fabric.cli", "chat", "--tracker", cluster.endpoint, "--model",
                             model, "--max-tokens", str(TOKENS), MESSAGES[0]["content"]], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        shown = proc.stdout.read(1)  # the reply's first character: its head serves it
        _kill_when_tokens_come(cluster, known, [])
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and b"error" not in err, err
    return (shown + out).decode()
