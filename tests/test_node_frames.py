"""A real ``fabric.node.Node`` on loopback, fed malformed frames from a DEALER.

Every bad frame must be answered with an ERROR (decoded here with ``fabric.wire.protocol``,
code checked) and must never take the node down: afterwards it still answers PING and
still generates exactly what a single transformers process generates.
"""
from __future__ import annotations

import dataclasses
import math
import random
import threading
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from fabric import Client, FabricError
from fabric.compute.models import resolve
from fabric.compute.tensors import to_wire
from fabric.node import Node, NodeConfig
from fabric.wire import protocol as p
from fabric.wire.protocol import ErrorCode, Hop, Kind
from fabric.wire.shard import Shard
from tests.support import wait_for
from tests.tiny_models import make_model, reference_greedy

NUM_LAYERS = 6  # tiny_models' default
HIDDEN = 64
MAX_FRAME_BYTES = 1 << 20  # the node under test refuses larger tensor buffers
PROMPT = "the quick brown fox"
NEW_TOKENS = 12

BAD_FRAME, BAD_REQUEST, VERSION = ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.VERSION


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("node-frames") / "llama")


class RunningNode:
    """A Node serving in a thread; ``stop()`` ends its loop and joins the thread."""

    def __init__(self, model_dir: Path, node_id: str, **config):
        self.node = Node(NodeConfig.build(resolve(str(model_dir)), Shard(0, NUM_LAYERS - 1, NUM_LAYERS), tracker=None,
                                    progress=False, node_id=node_id, **config))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.node.run, args=(self.stop_event,), daemon=True,
                                       name=f"node-{node_id}")
        self.thread.start()
        assert self.node.ready.wait(10), "node did not start"

    @property
    def endpoint(self) -> str:
        return self.node.endpoint

    @property
    def node_id(self) -> str:
        return self.node.config.node_id

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "node thread did not stop"


@pytest.fixture(scope="module")
def node(tiny_llama):
    running = RunningNode(tiny_llama, "frames-node", max_frame_bytes=MAX_FRAME_BYTES)
    yield running
    running.stop()


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


@pytest.fixture
def dealer(node):
    sock = _dealer(node.endpoint)
    yield sock
    sock.close(linger=0)


@pytest.fixture
def reply_router():
    """A ROUTER standing in for a head: FORWARD's reply_to points here."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


def receive(sock: zmq.Socket, timeout: float = 5.0) -> p.Message:
    assert sock.poll(timeout * 1000), "no reply"
    if sock.type == zmq.ROUTER:
        return p.decode(p.split_envelope(sock.recv_multipart())[1])[0]
    return p.decode(sock.recv_multipart(copy=False))[0]


def ping(sock: zmq.Socket, nonce: int = 1) -> p.Pong:
    sock.send_multipart(p.encode(p.Ping(nonce)))
    reply = receive(sock)
    assert isinstance(reply, p.Pong) and reply.nonce == nonce, reply
    return reply


# --------------------------------------------------------------------------- malformed frames


def _forward(start: int, end: int, tensor: torch.Tensor, route=(), reply_to: str = "tcp://127.0.0.1:1",
             session: str = "bad", pos: int = 0) -> tuple[p.Forward, list]:
    spec, buf = to_wire(tensor)
    return p.Forward(session=session, step=0, pos=pos, start_layer=start, end_layer=end, route=tuple(route),
                     reply_to=reply_to, tensors=(spec,)), [buf]


def _frames(message: p.Message, buffers=()) -> list[bytes]:
    return [bytes(f) for f in p.encode(message, buffers)]


def _raw(kind: int, header, *buffers, magic: bytes = p.MAGIC) -> list[bytes]:
    return [magic, bytes([kind]), msgpack.packb(header, use_bin_type=True), *buffers]


IDS = torch.tensor([[1, 5, 7]], dtype=torch.int64)  # (1, q)
HIDDEN_STATES = torch.zeros(1, 2, HIDDEN)  # (1, q, hidden)
FORWARD_IDS = _frames(*_forward(0, NUM_LAYERS - 1, IDS))
FORWARD_HIDDEN_HEADER = msgpack.unpackb(_frames(*_forward(3, NUM_LAYERS - 1, HIDDEN_STATES))[2])
RNG = random.Random(20261129)


def _hidden_header(**changes) -> dict:
    return {**FORWARD_HIDDEN_HEADER, **changes}


def _generate_header(**changes) -> dict:
    g = p.Generate(request_id="bad-gen", route=(Hop("x", "tcp://127.0.0.1:1", 0, NUM_LAYERS - 1),), prompt="hi")
    return {**msgpack.unpackb(p.encode(g)[2]), **changes}


MALFORMED = {
    # (frames, expected ERROR code, a phrase of the message)
    "one frame of random bytes": ([RNG.randbytes(37)], BAD_FRAME, "at least 3 frames"),
    "frames of random bytes": ([b"\x00" + RNG.randbytes(6), RNG.randbytes(5), RNG.randbytes(100)], BAD_FRAME,
                               "bad magic"),
    "an empty frame": ([b""], BAD_FRAME, "at least 3 frames"),
    "REQ-style empty delimiter": ([b"", *_frames(p.Ping(1))], BAD_FRAME, "bad magic"),
    "truncated: magic only": ([p.MAGIC], BAD_FRAME, "at least 3 frames"),
    "truncated: no header": (FORWARD_IDS[:2], BAD_FRAME, "at least 3 frames"),
    "truncated: header cut short": ([*FORWARD_IDS[:2], FORWARD_IDS[2][:40], FORWARD_IDS[3]], BAD_FRAME,
                                    "not valid msgpack"),
    "truncated: buffer missing": (FORWARD_IDS[:3], BAD_FRAME, "names 1 tensors but 0 buffers"),
    "truncated: buffer cut short": ([*FORWARD_IDS[:3], FORWARD_IDS[3][:-1]], BAD_FRAME, "buffer has 23"),
    "lying size: buffer too long": ([*FORWARD_IDS[:3], FORWARD_IDS[3] + bytes(8)], BAD_FRAME, "buffer has 32"),
    "lying size: 2 GiB spec, 24-byte buffer": (
        _raw(Kind.FORWARD, _hidden_header(tensors=[{"dtype": "float32", "shape": [1, 1 << 13, 1 << 16]}]),
             bytes(24)), BAD_FRAME, "exceeds the %d-byte limit" % MAX_FRAME_BYTES),
    "oversized buffer (2 MiB, honest spec)": (
        _raw(Kind.FORWARD, _hidden_header(tensors=[{"dtype": "float32", "shape": [1, 8192, HIDDEN]}]),
             bytes(2 << 20)), BAD_FRAME, "exceeds"),
    "too many buffers": (_raw(Kind.PING, {"nonce": 1, "tensors": [{"dtype": "int32", "shape": [1]}] * 9},
                              *[bytes(4)] * 9), BAD_FRAME, "at most 8"),
    "wrong dtype: float64": (
        _raw(Kind.FORWARD, _hidden_header(tensors=[{"dtype": "float64", "shape": [1, 2, HIDDEN]}]),
             bytes(8 * 2 * HIDDEN)), BAD_FRAME, "not allowed"),
    "wrong dtype: int32 input ids": (
        _raw(Kind.FORWARD, {**msgpack.unpackb(FORWARD_IDS[2]), "tensors": [{"dtype": "int32", "shape": [1, 3]}]},
             bytes(12)), BAD_FRAME, "int64 input_ids"),
    "wrong version": ([b"MESH2", *FORWARD_IDS[1:]], VERSION, "version"),
    "bare MESH magic": ([b"MESH", *FORWARD_IDS[1:]], VERSION, "version"),
    "unknown kind": (_raw(99, {"nonce": 1}), BAD_FRAME, "unknown message kind"),
    "two-byte kind": ([p.MAGIC, b"\x07\x00", msgpack.packb({"nonce": 1})], BAD_FRAME, "one byte"),
    "header is a list": (_raw(Kind.PING, [1]), BAD_FRAME, "msgpack map"),
    "header is not msgpack": ([p.MAGIC, bytes([Kind.PING]), b"\xc1\xc1"], BAD_FRAME, "not valid msgpack"),
    "unknown field": (_raw(Kind.PING, {"nonce": 1, "colour": "red"}), BAD_FRAME, "unknown fields"),
    "missing field": (_raw(Kind.PING, {}), BAD_FRAME, "missing field 'nonce'"),
    "bool where int expected": (_raw(Kind.PING, {"nonce": True}), BAD_FRAME, "must be an int"),
    "NaN temperature": (_raw(Kind.GENERATE, _generate_header(sampling={"temperature": math.nan})), BAD_FRAME,
                        "finite number"),
    "FORWARD route with a gap": (
        _raw(Kind.FORWARD, {**msgpack.unpackb(FORWARD_IDS[2]), "end_layer": 2,
                            "route": [{"node": "n", "endpoint": "e", "start_layer": 4, "end_layer": 5}]},
             FORWARD_IDS[3]), BAD_FRAME, "expected 3"),
    "FORWARD for layers the node lacks (4-9)": (
        _raw(Kind.FORWARD, _hidden_header(start_layer=4, end_layer=9), bytes(4 * 2 * HIDDEN)), BAD_REQUEST,
        "not on this node"),
    "FORWARD for layers past the model (6-7)": (
        _raw(Kind.FORWARD, _hidden_header(start_layer=6, end_layer=7), bytes(4 * 2 * HIDDEN)), BAD_REQUEST,
        "not on this node"),
    "FORWARD with a wrong hidden size": (
        _raw(Kind.FORWARD, _hidden_header(tensors=[{"dtype": "float32", "shape": [1, 2, HIDDEN - 1]}]),
             bytes(4 * 2 * (HIDDEN - 1))), BAD_FRAME, f"hidden size {HIDDEN - 1} != {HIDDEN}"),
    # the limits of protocol.py a node applies with its model's numbers (vocabulary 320, context 8192)
    "FORWARD with a token id past the vocabulary": (_frames(*_forward(0, NUM_LAYERS - 1, torch.tensor([[1, 320]]))),
                                                    BAD_REQUEST, "input_ids holds a token id outside the vocabulary"),
    "FORWARD past the model's context": (_frames(*_forward(0, NUM_LAYERS - 1, IDS, pos=8190)), BAD_REQUEST,
                                         "go past the model's context of 8192"),
    "FORWARD with 65 hops after it": (_frames(*_forward(0, NUM_LAYERS - 1, IDS, route=[
        Hop(f"h{i}", "tcp://127.0.0.1:1", NUM_LAYERS + i, NUM_LAYERS + i) for i in range(p.MAX_HOPS + 1)])),
        BAD_FRAME, "at most 64 hops"),
    "GENERATE along 65 hops": (_raw(Kind.GENERATE, _generate_header(route=[
        {"node": f"h{i}", "endpoint": "tcp://127.0.0.1:1", "start_layer": i, "end_layer": i, "key": ""}
        for i in range(p.MAX_HOPS + 1)])), BAD_FRAME, "at most 64 hops"),
    "GENERATE with an empty route": (_raw(Kind.GENERATE, _generate_header(route=[])), BAD_REQUEST,
                                     "needs a route"),
    "GENERATE with prompt and messages": (
        _raw(Kind.GENERATE, _generate_header(messages=[{"role": "user", "content": "hi"}])), BAD_REQUEST,
        "exactly one of"),
    "GENERATE with top_p 0": (_raw(Kind.GENERATE, _generate_header(sampling={"top_p": 0.0})), BAD_REQUEST,
                              "top_p"),
    "GENERATE for a route this node does not head": (_raw(Kind.GENERATE, _generate_header()), BAD_REQUEST,
                                                     "not the head"),
    "a tracker message (ROUTE_REQUEST)": (_frames(p.RouteRequest("llama")), BAD_REQUEST, "does not accept"),
    "FORWARD asking 21 logprobs": (_raw(Kind.FORWARD, {**msgpack.unpackb(FORWARD_IDS[2]), "logprobs": 21},
                                        FORWARD_IDS[3]), BAD_FRAME, "logprobs must be in [-1, 20]"),
    "GENERATE asking 21 logprobs": (_raw(Kind.GENERATE, _generate_header(logprobs=21)), BAD_REQUEST,
                                    "logprobs must be in [-1, 20]"),
    "TOKEN with 21 alternatives": (_raw(Kind.TOKEN, {"session": "s", "step": 0, "token": 1, "pos": 1, "logprob": -1.0,
                                                     "top_ids": list(range(21)), "top_logprobs": [-1.0] * 21}),
                                   BAD_FRAME, "at most 20"),
    "TOKEN with unpaired alternatives": (_raw(Kind.TOKEN, {"session": "s", "step": 0, "token": 1, "pos": 1,
                                                           "logprob": -1.0, "top_ids": [1, 2], "top_logprobs": [-1.0]}),
                                         BAD_FRAME, "pair up"),
    "TOKEN with a positive logprob": (_raw(Kind.TOKEN, {"session": "s", "step": 0, "token": 1, "pos": 1,
                                                        "logprob": 3.0}), BAD_FRAME, "logprobs must be in"),
    "FORWARD with a bias of 101": (_raw(Kind.FORWARD, {**msgpack.unpackb(FORWARD_IDS[2]), "penalties": {
        "bias_ids": [5], "bias_values": [101.0]}}, FORWARD_IDS[3]), BAD_REQUEST, "bias in [-100, 100]"),
    "GENERATE biasing 301 tokens": (_raw(Kind.GENERATE, _generate_header(penalties={
        "bias_ids": list(range(301)), "bias_values": [1.0] * 301})), BAD_REQUEST, "at most 300"),
    "GENERATE with a presence penalty of 3": (_raw(Kind.GENERATE, _generate_header(penalties={"presence": 3.0})),
                                              BAD_REQUEST, "penalties must be in [-2, 2]"),
    "FORWARD with a grammar of an unknown kind": (_raw(Kind.FORWARD, {**msgpack.unpackb(FORWARD_IDS[2]), "grammar": {
        "kind": "xml", "source": "<a/>"}}, FORWARD_IDS[3]), BAD_REQUEST, "grammar kind must be one of"),
    "FORWARD with a json_object grammar that has a source": (_raw(Kind.FORWARD, {
        **msgpack.unpackb(FORWARD_IDS[2]), "grammar": {"kind": "json_object", "source": "{}"}}, FORWARD_IDS[3]),
        BAD_REQUEST, "json_object has no source"),
    "GENERATE with a schema over 64 KiB": (_raw(Kind.GENERATE, _generate_header(grammar={
        "kind": "json_schema", "source": " " * (p.MAX_GRAMMAR + 1)})), BAD_REQUEST, "at most 65536 characters"),
    "EVENT with 21 alternatives": (_raw(Kind.EVENT, {"request_id": "r", "event": "token", "logprobs": [
        {"token": 1, "text": "a", "logprob": -1.0, "top": [{"token": 1, "text": "a", "logprob": -1.0}] * 21}]}),
        BAD_REQUEST, "at most 20"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frame_gets_an_error(node, dealer, case):
    frames, code, phrase = MALFORMED[case]
    dealer.send_multipart(frames)
    reply = receive(dealer)
    assert isinstance(reply, p.Error), reply
    assert reply.code == code, f"{reply.code}: {reply.message}"
    assert phrase in reply.message, reply.message
    assert reply.node == node.node_id and reply.session == _session_of(frames), reply
    assert node.thread.is_alive()
    ping(dealer)


def _session_of(frames: list) -> str | None:
    """The session a refusal of ``frames`` names: a FORWARD's that decodes (within the node's
    frame limit), so that its head can end that request; none for a frame that does not."""
    try:
        msg = p.decode(frames, MAX_FRAME_BYTES)[0]
    except p.ProtocolError:
        return None
    return msg.session if isinstance(msg, p.Forward) else None


@pytest.mark.parametrize("field, changes", [
    ("resume", dict(resume=(5, 320))),
    ("logit_bias", dict(penalties=p.Penalties(bias_ids=(320,), bias_values=(1.0,)))),
])
def test_token_ids_past_the_vocabulary_are_refused_by_name(node, dealer, field, changes):
    """A GENERATE this node heads, naming a token id its model does not have: an error event
    (bad_request) says which field, and the node goes on serving."""
    route = (Hop(node.node_id, node.endpoint, 0, NUM_LAYERS - 1),)
    dealer.send_multipart(p.encode(p.Generate(request_id=f"vocab-{field}", route=route, prompt="hi", **changes)))
    reply = receive(dealer)
    assert isinstance(reply, p.Event) and reply.event == "error", reply
    assert reply.error_code == BAD_REQUEST and f"{field} holds a token id outside the vocabulary [0, 320)" in reply.text
    assert node.thread.is_alive()
    ping(dealer)


def test_ping_gets_pong(node, dealer):
    for nonce in (0, 7, 2**64 - 1):
        pong = ping(dealer, nonce)
        assert pong.node == node.node_id and pong.sessions >= 0
    # raw bytes, as a script in another language would build them
    dealer.send_multipart([b"MESH1", b"\x07", bytes.fromhex("81a56e6f6e6365cd3039")])  # {"nonce": 12345}
    assert receive(dealer) == p.Pong(12345, node=node.node_id, sessions=ping(dealer).sessions)


def test_replies_and_errors_are_not_answered(node, dealer):
    # a node ignores PONG, ACK and session-less ERROR: answering them could loop two peers forever
    for message in (p.Pong(1), p.Ack(), p.Error(ErrorCode.INTERNAL, "x")):
        dealer.send_multipart(p.encode(message))
    assert not dealer.poll(300)
    ping(dealer)


def test_forward_flow_to_reply_to(node, dealer, reply_router, tiny_llama):
    """FORWARD -> TOKEN at reply_to; a gap -> CACHE_MISS; CLOSE frees the session's KV."""
    router, reply_to = reply_router
    ids = [1, 5, 7, 9]
    expected = reference_greedy(tiny_llama, ids, 2)
    before = ping(dealer).sessions
    msg, bufs = _forward(0, NUM_LAYERS - 1, torch.tensor([ids]), reply_to=reply_to, session="flow")
    dealer.send_multipart(p.encode(msg, bufs), copy=False)
    token = receive(router)
    assert token == p.Token("flow", 0, expected[0], len(ids))
    assert ping(dealer).sessions == before + 1

    nxt = p.Forward(**{**_fields(msg), "step": 1, "pos": len(ids),
                       "tensors": (to_wire(torch.tensor([[token.token]]))[0],)})
    dealer.send_multipart(p.encode(nxt, [to_wire(torch.tensor([[token.token]]))[1]]))
    assert receive(router) == p.Token("flow", 1, expected[1], len(ids) + 1)

    gap = p.Forward(**{**_fields(nxt), "step": 2, "pos": len(ids) + 5})
    dealer.send_multipart(p.encode(gap, [to_wire(torch.tensor([[3]]))[1]]))
    assert receive(router) == p.CacheMiss("flow", 2, node.node_id, len(ids) + 1)

    dealer.send_multipart(p.encode(p.Close("flow")))
    assert wait_for(lambda: ping(dealer).sessions == before, 5)


def test_a_batch_is_read_message_by_message_and_a_bad_one_costs_only_itself(node, dealer, reply_router,
                                                                          tiny_llama):
    router, reply_to = reply_router
    prompts, before = {"batch-a": [1, 5, 7, 9], "batch-b": [2, 4, 6]}, ping(dealer).sessions
    bodies = [_frames(*_forward(0, NUM_LAYERS - 1, torch.tensor([ids]), reply_to=reply_to, session=session))
              for session, ids in prompts.items()]
    dealer.send_multipart(p.encode_batch([bodies[0], _raw(Kind.PING, {"nonce": "x"}), bodies[1]]))
    error = receive(dealer)
    assert isinstance(error, p.Error) and error.code == BAD_FRAME and "nonce" in error.message
    tokens = {}
    while len(tokens) < len(prompts):  # both steps ran: one TOKEN each (in one BATCH where one pass ran both)
        assert router.poll(5000), tokens
        for body in p.unbatch(p.split_envelope(router.recv_multipart())[1]):
            token = p.decode(body)[0]
            tokens[token.session] = token.token
    assert tokens == {session: reference_greedy(tiny_llama, ids, 1)[0] for session, ids in prompts.items()}
    dealer.send_multipart(_raw(p.BATCH_KIND, {"counts": [3, 3]}, *_frames(p.Ping(1))))  # counts past its frames
    assert receive(dealer).code == BAD_FRAME
    dealer.send_multipart(p.encode_batch([_frames(p.Close(session)) for session in prompts]))
    assert wait_for(lambda: ping(dealer).sessions == before, 5)


def test_one_drain_of_the_router_reads_at_most_max_drain_messages_however_they_are_batched():
    """A flood of BATCHes cannot hold the node's loop longer than as many single messages would:
    each message a BATCH carries counts against the loop's budget for one socket."""
    from fabric.node.node import MAX_DRAIN, Node

    batch = p.encode_batch([p.encode(p.Ping(i)) for i in range(p.MAX_BATCH)])

    class Router:
        reads = 0

        def recv_multipart(self, flags, copy):
            self.reads += 1
            return [zmq.Frame(b"peer"), *(zmq.Frame(f) for f in batch)]

    class Loop:
        router, _taps, read = Router(), [], 0

        def inbound(self, identity, frames):
            self.read += len(p.unbatch(frames))
            return len(p.unbatch(frames))

    loop = Loop()
    Node._drain(loop, loop.router)
    assert loop.router.reads == -(-MAX_DRAIN // p.MAX_BATCH) and loop.read < MAX_DRAIN + p.MAX_BATCH


def test_a_grammar_the_tail_cannot_compile_is_a_bad_request_for_that_session(node, dealer, reply_router):
    """A peer that bypasses the head's check: the tail answers ERROR(bad_request) for the
    session, drops it, and goes on serving (a sound constrained session right after)."""
    router, reply_to = reply_router
    before = ping(dealer).sessions
    msg, bufs = _forward(0, NUM_LAYERS - 1, torch.tensor([[1, 5, 7]]), reply_to=reply_to, session="bad-grammar")
    bad = dataclasses.replace(msg, grammar=p.Grammar(p.GrammarKind.REGEX, "[a-"))
    dealer.send_multipart(p.encode(bad, bufs), copy=False)
    error = receive(router)
    assert isinstance(error, p.Error) and error.code == BAD_REQUEST and error.session == "bad-grammar", error
    assert error.message.startswith("GrammarError:") and "regex" in error.message, error.message
    assert wait_for(lambda: ping(dealer).sessions == before, 5)
    good = dataclasses.replace(msg, session="good-grammar", grammar=p.Grammar(p.GrammarKind.REGEX, "[0-9]+"))
    dealer.send_multipart(p.encode(good, bufs), copy=False)
    token = receive(router)
    assert isinstance(token, p.Token) and token.session == "good-grammar", token
    dealer.send_multipart(p.encode(p.Close("good-grammar")))


def _fields(message: p.Message) -> dict:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}


def test_node_still_generates_after_garbage(node, dealer, tiny_llama):
    from transformers import AutoTokenizer

    for frames, _, _ in MALFORMED.values():  # everything at once, replies collected afterwards
        dealer.send_multipart(frames)
    replies = [receive(dealer) for _ in MALFORMED]
    assert all(isinstance(r, p.Error) for r in replies)
    assert node.thread.is_alive()

    ids = AutoTokenizer.from_pretrained(tiny_llama)(PROMPT, add_special_tokens=True)["input_ids"]
    expected = reference_greedy(tiny_llama, ids, NEW_TOKENS)
    route = (Hop(node.node_id, node.endpoint, 0, NUM_LAYERS - 1),)
    with Client(timeout=20) as client:  # route given: the tracker is never asked
        events = list(client.generate("llama", prompt=PROMPT, max_tokens=NEW_TOKENS, route=route))
    assert events[0].event == "start" and events[0].prompt_tokens == len(ids)
    assert events[-1].event == "done"
    tokens = [t for e in events if e.event == "token" for t in e.token_ids]
    if events[-1].finish_reason == "length":
        assert tokens == expected
    else:  # the random model may emit EOS (id 2) before max_tokens
        assert events[-1].finish_reason == "stop" and tokens[-1] == 2
        assert tokens == expected[:len(tokens)]
    assert wait_for(lambda: ping(dealer).sessions == 0, 5)  # every session's KV was freed


# --------------------------------------------------------------------------- impossible frames
#
# Well-formed frames that pass protocol validation but ask for something impossible (a
# route that stops early, an endpoint that is not one). Each runs against a fresh node,
# which must survive.


REFUSED, DROPPED = "rejected_frames", "dropped_frames"  # the counter each kind of failure moves


def _crash_cases(endpoint: str, head: str) -> dict:
    """case -> (frames, what must happen): REFUSED is an ERROR(bad_request): a FORWARD's goes
    to its reply_to, the ``head``, naming its session and step; a GENERATE's back to the sender.
    DROPPED is a frame the node ran but could not answer (its reply_to is no endpoint)."""
    short = _forward(0, 2, IDS, reply_to=head)  # ends before the last layer, no route after it
    bad_reply = _forward(0, NUM_LAYERS - 1, IDS, reply_to="not-an-endpoint")
    bad_hop = _forward(0, 2, IDS, route=(Hop("x", "bogus", 3, NUM_LAYERS - 1),), reply_to=head)
    generate = p.Generate(request_id="short", route=(Hop("n", endpoint, 0, 2),), prompt="hi")
    return {"forward with no route after a non-final span": (p.encode(*short), REFUSED, "no hop follows"),
            "forward whose reply_to is not an endpoint": (p.encode(*bad_reply), DROPPED, ""),
            "forward whose next hop is not an endpoint": (p.encode(*bad_hop), REFUSED,
                                                          "the next hop's endpoint 'bogus' cannot be dialled"),
            "generate whose route stops before the last layer": (p.encode(generate), REFUSED, "last layer")}


@pytest.mark.parametrize("case", list(_crash_cases("tcp://127.0.0.1:1", "tcp://127.0.0.1:2")))
def test_valid_but_impossible_frames_do_not_kill_the_node(tiny_llama, reply_router, case):
    """The node refuses or drops the frame (its counter says which), answers nothing else to
    the sender, and still answers PING."""
    victim = RunningNode(tiny_llama, "victim")
    sock = _dealer(victim.endpoint)
    head, head_endpoint = reply_router
    try:
        frames, outcome, phrase = _crash_cases(victim.endpoint, head_endpoint)[case]
        sock.send_multipart(frames)
        counters = victim.node.counters
        assert wait_for(lambda: counters[outcome] == 1, 10), dict(counters)
        assert victim.thread.is_alive(), "the node's loop died"
        if outcome == REFUSED:  # a route that stops early, or a hop no one can dial, is refused up front
            forward = case.startswith("forward")  # told to the sender, and to the head, by session
            for reply in [receive(sock), *([receive(head)] if forward else [])]:
                assert isinstance(reply, p.Error) and reply.code == BAD_REQUEST, reply
                assert phrase in reply.message, reply.message
                assert (reply.session, reply.step) == (("bad", 0) if forward else (None, None)), reply
        assert isinstance(ping(sock), p.Pong)  # and, for a dropped frame, the first thing the sender hears
        assert counters[REFUSED] + counters[DROPPED] == 1, dict(counters)
    finally:
        sock.close(linger=0)
        victim.stop_event.set()
        victim.thread.join(10)


def test_a_request_whose_second_hop_no_one_can_dial_ends_with_that_reason(tiny_llama):
    """The head runs its own span, then cannot send the step on: the client hears why at once,
    as an error event naming the hop, instead of waiting out every re-send."""
    head = RunningNode(tiny_llama, "head")
    route = (Hop(head.node_id, head.endpoint, 0, 2), Hop("gone", "bogus", 3, NUM_LAYERS - 1))
    try:
        with Client(timeout=20) as client:  # route given: the tracker is never asked
            with pytest.raises(FabricError, match="cannot be dialled") as refused:
                list(client.generate("llama", prompt=PROMPT, max_tokens=4, route=route))
        assert refused.value.code == BAD_REQUEST, refused.value
        assert wait_for(lambda: len(head.node.head) == 0 and len(head.node.kv) == 0, 5)
    finally:
        head.stop()
