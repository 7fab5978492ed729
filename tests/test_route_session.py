"""Characterization of the Route Session seam, driven without sockets or HTTP.

An in-memory transport connects the session to shard executors of a split model, so the
test sees exactly the frames the session sends: prefill, decode, cache-miss re-prefill,
cancellation and cleanup.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
import torch

from fabric.compute.executor import CacheMissError, ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_shard, resolve
from fabric.compute.sampling import sample
from fabric.net.peer_liveness import splice
from fabric.node.head import Head, HeadConfig, ServedModel
from fabric.node.route_session import Detokenizer, RouteSession, eos_ids
from fabric.wire.liveness import TRACKER_SILENCE
from fabric.wire.protocol import (
    CacheMiss,
    Cancel,
    Close,
    Error,
    ErrorCode,
    EventKind,
    Forward,
    Generate,
    Hop,
    Progress,
    Route,
    RouteRequest,
    Token,
)
from fabric.wire.shard import Shard
from tests.tiny_models import reference_greedy


class LocalTransport:
    """Runs each FORWARD on in-process executors and queues the tail's reply."""

    def __init__(self, executors: dict[str, ShardExecutor]):
        self.executors = executors
        self.replies: list = []
        self.sent: list[Forward] = []
        self.controls: list = []

    def forward(self, hop: Hop, message: Forward, tensor: torch.Tensor) -> None:
        self.sent.append(message)
        x, hops = tensor, (hop, *message.route)
        try:
            for h in hops:
                result = self.executors[h.node].run(message.session, h.start_layer, h.end_layer, x, message.pos)
                x = result.hidden
        except CacheMissError as miss:
            self.replies.append(CacheMiss(message.session, message.step, h.node, miss.have))
            return
        pos = message.pos + tensor.shape[1]
        self.replies.append(Token(message.session, message.step, sample(result.logits, message.sampling, pos), pos))

    def control(self, hop: Hop, message) -> None:
        self.controls.append(message)
        for h in (hop, *message.route):
            self.executors[h.node].kv.drop(message.session)


def new_session(split, max_tokens=16, stop=(), eos=frozenset(), ignore_eos=False, prompt="the quick brown fox"):
    model_dir, executors, tok, route = split
    request = Generate(request_id="r1", route=route, prompt=prompt, max_tokens=max_tokens, stop=stop,
                       ignore_eos=ignore_eos)
    ids = tok(request.prompt)["input_ids"]
    transport = LocalTransport(executors)
    rs = RouteSession(request, ids, tokenizer=tok, eos=eos, reply_to="inproc://h",
                      transport=transport, seed=7, session=request.request_id)
    return rs, transport, ids


def drive(rs, transport, on_reply=None):
    events = rs.start()
    while transport.replies and not rs.finished:
        reply = transport.replies.pop(0)
        if on_reply:
            on_reply(reply)
        events += rs.on_token(reply) if isinstance(reply, Token) else rs.on_cache_miss(reply)
    return events


def test_prefill_then_decode_matches_transformers(split):
    rs, transport, ids = new_session(split)
    events = drive(rs, transport)
    tokens = [t for e in events if e.event == "token" for t in e.token_ids]
    assert tokens == reference_greedy(split[0], ids, 16)
    assert transport.sent[0].pos == 0 and len(transport.sent) == 16  # one prefill, 15 decode steps
    assert [m.pos for m in transport.sent[1:]] == list(range(len(ids), len(ids) + 15))
    assert events[-1].event == "done" and events[-1].finish_reason == "length"
    assert isinstance(transport.controls[-1], Close)  # cleanup reached every hop
    assert all(len(ex.kv) == 0 for ex in split[1].values())


def test_eos_ends_a_request_unless_it_asks_to_ignore_it(split):
    model_dir, _, tok, _ = split
    ids = tok("the quick brown fox")["input_ids"]
    reference = reference_greedy(model_dir, ids, 16)
    eos = frozenset({reference[2]})  # as if the third greedy token ended the sequence
    first = reference.index(reference[2])  # the first time that token comes
    rs, transport, _ = new_session(split, eos=eos)
    events = drive(rs, transport)
    assert [t for e in events for t in e.token_ids] == reference[:first + 1]
    assert events[-1].finish_reason == "stop"
    rs, transport, _ = new_session(split, eos=eos, ignore_eos=True)
    events = drive(rs, transport)
    assert [t for e in events for t in e.token_ids] == reference  # every one of max_tokens
    assert events[-1].finish_reason == "length"


def test_cache_miss_reprefills_full_history(split):
    rs, transport, ids = new_session(split)

    def evict_once(reply):
        if isinstance(reply, Token) and reply.step == 4:
            split[1]["t"].kv.drop("r1")

    events = drive(rs, transport, evict_once)
    tokens = [t for e in events if e.event == "token" for t in e.token_ids]
    assert tokens == reference_greedy(split[0], ids, 16)
    reprefill = [m for m in transport.sent if m.pos == 0][1]
    assert rs.cache_misses == 1 and reprefill.step == 6


def test_cancel_frees_every_hop(split):
    rs, transport, _ = new_session(split, max_tokens=50)
    rs.start()
    rs.on_token(transport.replies.pop(0))
    assert all(len(ex.kv) == 1 for ex in split[1].values())
    events = rs.cancel()
    assert events[-1].finish_reason == "cancelled"
    assert isinstance(transport.controls[-1], Cancel) and transport.controls[-1].route == split[3][1:]
    assert all(len(ex.kv) == 0 for ex in split[1].values())
    assert rs.on_token(transport.replies.pop(0)) == []  # late replies are ignored


def test_stale_step_is_ignored(split):
    rs, transport, _ = new_session(split)
    rs.start()
    reply = transport.replies.pop(0)
    stale = Token(reply.session, reply.step + 5, reply.token, reply.pos)
    assert rs.on_token(stale) == [] and not transport.sent[1:]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("stop,expect", [(("cd",), "ab"), (("x",), "abcde"), (("bcz",), "abcde")])
def test_detokenizer_holds_back_stop_prefixes(stop, expect):
    d = Detokenizer(FakeTokenizer(), stop)
    out, stopped = "", False
    for ch in "abcde":
        text, stopped = d.add(ord(ch))
        out += text
        if stopped:
            break
    if not stopped:
        out += d.flush()
    assert out == expect


def test_eos_ids_collects_tokenizer_and_config(split):
    tok = split[2]

    class C:
        eos_token_id = [2, 9]
    assert eos_ids(tok, C()) == frozenset({tok.eos_token_id, 2, 9})


def test_a_prefill_that_keeps_moving_is_not_timed_out(split):
    rs, transport, _ = new_session(split)
    rs.start()
    transport.replies.clear()  # the reply is slow: the prompt is long
    sent = len(transport.sent)
    t0 = rs.sent_at
    rs.on_progress(Progress(rs.session, rs.step, "t", 5, 2), t0 + 25, 0.5)  # the tail ran another chunk of it
    assert rs.check_timeout(t0 + 40, timeout=30) == [] and len(transport.sent) == sent
    rs.on_progress(Progress(rs.session, rs.step - 1, "t", 5, 3), t0 + 50, 0.5)  # an old step's: no sign of this one
    assert rs.check_timeout(t0 + 56, timeout=30) == [] and len(transport.sent) == sent + 1  # then silence: re-sent


def test_prefill_progress_weighs_each_hop_by_its_layers(split):
    """A 2-hop route of 3 layers each: the head's chunks count half, the tail's the rest; a
    hop holds at least what a later one holds; the client hears only growth."""
    rs, transport, _ = new_session(split, prompt="the quick brown fox jumps over the lazy dog " * 3)
    rs.start()
    total = rs.prompt_tokens
    assert total > 8 and rs.prefill.total == total

    def progress(node: str, end: int, done: int) -> list:
        return rs.on_progress(Progress(rs.session, rs.step, node, end, done), rs.sent_at, 0.5)

    [event] = progress("h", 2, 4)
    assert event.event == EventKind.PROGRESS and (event.prefilled, event.prefill_tokens) == (2, total)
    assert event.text == "" and event.token_ids == () and event.prompt_tokens == total
    assert progress("h", 2, 4) == []  # no growth, no event
    [event] = progress("t", 5, 6)  # the tail is past what the head reported: the head holds 6 too
    assert event.prefilled == 6
    assert progress("h", 2, total)[0].prefilled == (total + 6) // 2
    rs.on_token(transport.replies.pop(0))  # the first token: decode steps prefill nothing
    assert rs.prefill.total == 0 and rs.prefilled == 0 and progress("t", 5, total + 1) == []


def test_a_step_waiting_in_a_queue_keeps_its_client_and_its_timeout(split):
    """A hop reports a step still queued there (done = what it held before): no growth, but
    the step is not lost, and a client that heard nothing for a while hears that."""
    rs, transport, _ = new_session(split, prompt="the quick brown fox jumps over the lazy dog " * 3)
    rs.start()
    t0 = rs.sent_at
    [event] = rs.on_progress(Progress(rs.session, rs.step, "h", 2, 0), t0 + 20, 0.5)
    assert (event.prefilled, event.prefill_tokens) == (0, rs.prompt_tokens) and rs.sent_at == t0 + 20
    assert rs.on_progress(Progress(rs.session, rs.step, "h", 2, 0), t0 + 20.3, 0.5) == []  # it just heard
    assert rs.check_timeout(t0 + 45, timeout=30) == [] and rs.retries == 0
    assert len(rs.on_progress(Progress(rs.session, rs.step, "h", 2, 0), t0 + 21, 0.5)) == 1


class SilentHost:
    """A head's node whose hops and tracker never answer: it only records what it sends."""

    endpoint, key = "inproc://h", ""

    def __init__(self):
        self.to_client: list = []
        self.asked: list = []

    def reply(self, identity, message) -> None:
        self.to_client.append(message)

    def to_tracker(self, message) -> bool:
        self.asked.append(message)
        return True  # sent; the tracker dies before it answers

    def busy(self) -> bool:
        return False

    def reach(self, hop) -> None:
        pass  # every hop can be dialled

    def forward(self, hop, message, tensor) -> None:
        pass

    def control(self, hop, message) -> None:
        pass


def asked(host: SilentHost) -> list[RouteRequest]:
    return [m for m in host.asked if isinstance(m, RouteRequest)]


def silent_head(split) -> tuple[SilentHost, Head, RouteSession]:
    """A head whose request r1 runs on ``split``'s route h -> t, with nothing answering."""
    _, _, tok, route = split
    host = SilentHost()
    head = Head(HeadConfig(), host, "h", ServedModel("tiny", 6, tok, frozenset()), Counter())
    head.generate(b"client", Generate(route=route, request_id="r1", prompt="the quick brown fox", max_tokens=4))
    return host, head, head.request(b"client", "r1")


def test_a_failover_whose_route_request_is_lost_stays_on_its_route_and_asks_again(split):
    route = split[3]
    host, head, rs = silent_head(split)
    now = time.monotonic()
    head.lost({"inproc://t"}, now)

    assert rs.awaiting_route and len(asked(host)) == 1
    head.tick(now + TRACKER_SILENCE / 2)
    assert rs.awaiting_route  # the tracker may still answer
    head.tick(now + TRACKER_SILENCE)
    assert not rs.awaiting_route and not rs.finished and "t" not in rs.excluded  # waits for t, asks again later
    head.route_answer(Route("tiny", route))  # the lost answer, late: nothing waits on it any more
    assert head.request(b"client", "r1") is rs and not rs.finished
    head.lost({"inproc://t"}, rs.replan_after)
    assert rs.awaiting_route and len(asked(host)) == 2


def test_a_route_through_a_failed_hop_is_not_taken_and_fails_nothing(split):
    rs, _, _ = new_session(split)
    route = split[3]
    rs.start()
    rs.begin_failover({"t"})
    assert rs.reroute(route) == [] and not rs.finished  # an answer meant for another request
    assert rs.route == route and not rs.awaiting_route and rs.replan_after > time.monotonic()


def test_no_route_around_every_lost_hop_asks_again_around_fewer(split):
    """A request that lost tail t0 earlier and now loses t: the tracker knows no route around
    both, so the head asks around t alone, then around nobody; a route back to t's dead
    endpoint is not taken, one to t restarted at another endpoint is."""
    route = split[3]
    host, head, rs = silent_head(split)
    rs.excluded.add("t0")
    head.lost({"inproc://t"}, time.monotonic())
    no_route = Error(ErrorCode.NO_ROUTE, "layers 3-5 are not served")
    for exclude in (("t", "t0"), ("t",), ()):
        assert asked(host)[-1].exclude == exclude and rs.awaiting_route
        head.route_answer(no_route if exclude else Route("tiny", route))  # t still listed, at its dead endpoint
    assert not rs.awaiting_route and rs.route == route and not rs.finished  # waits for t to come back
    head.lost({"inproc://t"}, rs.replan_after)
    head.route_answer(no_route)
    back = Hop("t", "inproc://t-restarted", 3, 5)
    head.route_answer(Route("tiny", (route[0], back)))
    assert rs.route == (route[0], back) and not rs.awaiting_route and not rs.finished


def test_only_a_hop_of_the_route_that_leaves_is_gone_around(split):
    host, head, rs = silent_head(split)
    leaving = Error(ErrorCode.LEAVING, "leaving the swarm", session=rs.session, step=rs.step, node="elsewhere")
    head.deliver(rs.session, leaving)  # a node off this route (a replica asked for something else)
    assert not rs.awaiting_route and asked(host) == [] and not rs.finished
    head.deliver(rs.session, dataclasses.replace(leaving, node="t"))
    assert rs.awaiting_route and asked(host)[-1].exclude == ("t",)


def test_a_failover_that_gives_the_head_more_layers_keeps_the_tokens(split):
    """The head ran layers 0-1 beside a node now gone (2-2); the route around it gives the
    head its whole shard (0-2, see splice): the session re-prefills on the longer head hop
    and the greedy tokens stay transformers'."""
    model_dir, executors, tok, route = split
    executors["gone"] = ShardExecutor(load_shard(resolve(str(model_dir)), Shard(0, 2, 6), progress=False), KVStore())
    request = Generate(request_id="r1", route=(Hop("h", "inproc://h", 0, 1), Hop("gone", "inproc://g", 2, 2),
                                               route[1]), prompt="the quick brown fox", max_tokens=12)
    ids = tok(request.prompt)["input_ids"]
    transport = LocalTransport(executors)
    rs = RouteSession(request, ids, tokenizer=tok, eos=frozenset(), reply_to="inproc://h", transport=transport,
                      seed=7, session=request.request_id)
    events, steps = rs.start(), 0
    while transport.replies and not rs.finished:
        events += rs.on_token(transport.replies.pop(0))
        steps += 1
        if steps == 4:
            rs.begin_failover({"gone"})
            events += rs.reroute(splice(rs.route[0], route))
            assert rs.route == route and transport.sent[-1].pos == 0 and transport.sent[-1].end_layer == 2
    tokens = [t for e in events if e.event == "token" for t in e.token_ids]
    assert tokens == reference_greedy(model_dir, ids, 12) and events[-1].event == "done"


def test_prompt_plus_max_tokens_must_fit_the_context_unless_the_request_lets_the_head_fit_it(split):
    """A request for more than the context leaves is refused with the numbers; one that says
    ``fit_context`` gets what the context leaves; the same client may use one request id twice
    only after the first ended, another client at once."""
    _, _, tok, route = split
    host = SilentHost()
    head = Head(HeadConfig(), host, "h", ServedModel("tiny", 6, tok, frozenset(), context=20), Counter())
    prompt = "the quick brown fox"
    n = len(tok(prompt)["input_ids"])
    head.generate(b"a", Generate(route=route, request_id="r", prompt=prompt, max_tokens=21 - n))
    (refusal,) = host.to_client
    assert refusal.error_code == "bad_request" and f"context of 20 tokens: ask for at most {20 - n}" in refusal.text
    head.generate(b"a", Generate(route=route, request_id="r", prompt=prompt, max_tokens=64, fit_context=True))
    assert head.request(b"a", "r").request.max_tokens == 20 - n
    head.generate(b"b", Generate(route=route, request_id="r", prompt=prompt, max_tokens=20 - n))
    assert head.request(b"b", "r") is not head.request(b"a", "r")
    assert head.request(b"b", "r").session != head.request(b"a", "r").session
    assert head.cancel(b"b", "r") and head.request(b"a", "r") is not None  # b's cancel ends b's request only
