"""fabric.wire.protocol and fabric.compute.tensors: round trips, zero copy, rejection, and fuzzing.

Everything here is pure (no model, no node); the only sockets are an inproc PAIR to show
that frames received with ``copy=False`` decode without a copy, and a tracker thread that
runs the status example from docs/PROTOCOL.md.
"""
from __future__ import annotations

import dataclasses
import copy
import math
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fabric.compute.tensors import from_wire, to_wire
from fabric.wire import protocol as p
from fabric.wire.protocol import (
    ErrorCode,
    Hop,
    Kind,
    ProtocolError,
    Sampling,
    TensorSpec,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "PROTOCOL.md"

BAD_FRAME, BAD_REQUEST, VERSION = ErrorCode.BAD_FRAME, ErrorCode.BAD_REQUEST, ErrorCode.VERSION
CODES = {v for k, v in vars(ErrorCode).items() if not k.startswith("_")}

HEAD = Hop("a", "tcp://127.0.0.1:6000", 0, 2)
ROUTE = (Hop("b", "tcp://127.0.0.1:6001", 3, 5), Hop("c", "tcp://127.0.0.1:6002", 6, 7))
FULL = (HEAD, *ROUTE)
SAMPLING = Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=123)


def _ids(*ids: int) -> tuple[TensorSpec, memoryview]:
    return to_wire(torch.tensor([ids], dtype=torch.int64))  # (1, q)


def _hidden(q: int = 2, hidden: int = 8, dtype=torch.float32) -> tuple[TensorSpec, memoryview]:
    return to_wire(torch.arange(q * hidden, dtype=torch.float32).reshape(1, q, hidden).to(dtype))


def _forward_ids() -> tuple[p.Forward, list]:
    spec, buf = _ids(1, 5, 7)
    return p.Forward(session="s1", step=2, pos=0, start_layer=0, end_layer=2, route=ROUTE,
                     reply_to=HEAD.endpoint, sampling=SAMPLING, tensors=(spec,)), [buf]


def _forward_hidden(dtype=torch.float32) -> tuple[p.Forward, list]:
    spec, buf = _hidden(dtype=dtype)
    return p.Forward(session="s1", step=3, pos=9, start_layer=3, end_layer=5, route=ROUTE[1:],
                     reply_to=HEAD.endpoint, tensors=(spec,)), [buf]


def _forward_reuse() -> tuple[p.Forward, list]:
    spec, buf = _ids(1, 5, 7)
    return p.Forward(session="s2", step=0, pos=40, start_layer=0, end_layer=2, route=ROUTE,
                     reply_to=HEAD.endpoint, reuse="s1", tensors=(spec,)), [buf]


TAP_ID = "5f" * 16  # a session's tap id, as a head draws it


def _sketch(rows: int) -> tuple:
    return to_wire(torch.linspace(-1, 1, rows * p.SKETCH_DIM).reshape(rows, p.SKETCH_DIM))


def _audit_tap(tail: bool = False) -> tuple[p.AuditTap, list]:
    spec_in, buf_in = _sketch(3)
    spec_out, buf_out = _sketch(1 if tail else 3)  # a tail's logits: one row; hidden states: one a position
    return p.AuditTap(TAP_ID, "s1", 0, 0, 3, 5, token=42 if tail else -1,
                      tensors=(spec_in, spec_out)), [buf_in, buf_out]


def _audit() -> tuple[p.Audit, list]:
    spec, buf = _hidden(3)
    return p.Audit("a1f3" * 8, 3, 5, HEAD.endpoint, reply_key="k" * 40, tensors=(spec,)), [buf]


def _audit_result() -> tuple[p.AuditResult, list]:
    spec, buf = _hidden(3)
    return p.AuditResult("a1f3" * 8, tensors=(spec,)), [buf]


def _audit_samples() -> list[tuple[p.Message, list]]:
    chunk_in, chunk_buf = _sketch(5)
    ids, ids_buf = _ids(1, 5, 7)
    logits, logits_buf = to_wire(torch.linspace(-3, 3, 2 * 320).reshape(2, 320))  # (n, vocab)
    return [
        _audit_tap(), _audit_tap(tail=True),
        (p.AuditTap(TAP_ID, "s1", 0, 40, 3, 5, tensors=(chunk_in,)), [chunk_buf]),  # a tail's chunk: no output
        _audit(), _audit_result(),
        (p.Audit("b" * 32, 0, 2, HEAD.endpoint, tensors=(ids,)), [ids_buf]),  # the head's own layers on token ids
        (p.Audit("c" * 32, 3, 5, HEAD.endpoint, logits_from=1, tensors=(_hidden(3)[0],)), [_hidden(3)[1]]),
        (p.AuditResult("c" * 32, tensors=(logits,)), [logits_buf]),
        (p.AuditResult("a1f3", error="layers 3-5 are outside this node's shard 0-2"), []),
        (p.ReplicasRequest("a1f3", "tiny", "f00d", 3, 5, exclude=("a", "b"), node_id="a", suspect="b"), []),
        (p.Replicas("a1f3", ROUTE[:1], suspect_key="k" * 40), []),
        (p.Replicas("a1f3"), []),
        (p.Verdict("a", "tiny", "b", 3, 5, witnesses=("c", "d"), settled=True, detail="b vs c: 1.04"), []),
        (p.Verdict("a", "tiny", "b", 3, 5, witnesses=("c",)), []),
        (p.ManifestRequest("tiny"), []),
        (p.Manifest("tiny", "0" * 64, 0, 5, "a", tensors=(p.TensorSpec("uint8", (3,)),)), [b"{}\n"]),
        (p.ChunkRequest("0" * 64, "blk.3.attn_q.weight", 4096, 1 << 20, ref=9), []),
        (p.Chunk(9, "@kv", 0, tensors=(p.TensorSpec("uint8", (5,)),)), [b"GGUF\x03"]),
        (p.FetchReport("9f2c", "tiny", 3, 5, 1 << 20, 4 << 20, rate=5 << 20, bad_peers=("c",), node="b"), []),
        (p.FetchReport("9f2c", "tiny", 3, 5, 0, 4 << 20, final=True, error="no peer left"), []),
    ]


def samples() -> list[tuple[p.Message, list]]:
    """One or more valid messages of every kind, with non-default values where possible."""
    return [*_session_samples(), *_tracker_samples(), *_audit_samples()]


def _session_samples() -> list[tuple[p.Message, list]]:
    """The messages of a request: between client, head and nodes."""
    return [
        _forward_ids(),
        _forward_hidden(),
        _forward_hidden(torch.bfloat16),
        _forward_reuse(),
        (p.Token("s1", 2, 42, 8), []),
        (p.CacheMiss("s1", 2, "b", 4), []),
        (p.Progress("s1", 2, "b", 5, 96), []),
        (p.Cancel("s1", ROUTE), []),
        (p.Close("s1", ROUTE), []),
        (p.Close("s1"), []),
        (p.Error(ErrorCode.BUSY, "node is at its session limit", session="s1", step=2, node="b"), []),
        (p.Error(ErrorCode.BAD_FRAME, "bad magic frame"), []),
        (p.Ping(2**64 - 1), []),
        (p.Pong(7, node="b", sessions=3), []),
        (p.Generate(request_id="r1", route=FULL, messages=({"role": "user", "content": "hi"},), max_tokens=16,
                    stop=("\n\n",), sampling=SAMPLING, api_key="k"), []),
        (p.Generate(request_id="r2", route=(Hop("a", HEAD.endpoint, 0, 7),), prompt="once upon"), []),
        (p.Generate(request_id="r3", route=FULL, prompt="once upon", max_tokens=8, sampling=SAMPLING,
                    resume=(17, 0, 2**31 - 1)), []),
        (p.Event("r1", "start", route=FULL, prompt_tokens=3, seed=2**62 - 1), []),
        (p.Event("r1", "token", text="h\u00e9", token_ids=(1, 2), prompt_tokens=3, completion_tokens=2), []),
        (p.Event("r1", "progress", prompt_tokens=300, prefilled=96, prefill_tokens=300), []),
        (p.Event("r1", "done", finish_reason="stop", prompt_tokens=3, completion_tokens=9, route=FULL), []),
        (p.Event("r1", "error", text="no", finish_reason="error", error_code=ErrorCode.HOP_FAILED), []),
    ]


def _tracker_samples() -> list[tuple[p.Message, list]]:
    """The messages between nodes, clients and the tracker, and the relay's."""
    return [
        (p.Register(node_id="a", endpoint=HEAD.endpoint, model="tiny", fingerprint="f00d", num_layers=8,
                    start_layer=0, end_layer=2, hardware={"device": "cpu", "threads": 4}, benchmark=12.5,
                    max_sessions=64), []),
        (p.Register(node_id="r", endpoint="tcp://relay:40001", model="tiny", fingerprint="f00d", num_layers=8,
                    start_layer=3, end_layer=7, relay="tcp://relay:5557", relay_key="k" * 40), []),
        (p.Heartbeat("a", sessions=2, queued=1), []),
        (p.Heartbeat("a", rtts={"b": 0.75, "c": 31.5}), []),
        (p.Heartbeat("a", kv_bytes=46 << 20, kv_hits=4, kv_misses=1), []),
        (p.RouteRequest("tiny", exclude=("b",)), []),
        (p.Route("tiny", FULL, estimated_tps=15.5), []),
        (p.Report(request_id="r1", node_id="a", model="tiny", route=FULL, prompt_tokens=3, completion_tokens=9,
                  elapsed=1.25, final=True, finish_reason="stop", api_key="k", max_tokens=16), []),
        (p.Report(request_id="r2", node_id="a", model="tiny", route=FULL, prompt_tokens=300, elapsed=2.5,
                  prefilled=96, prefill_tokens=300), []),
        (p.Report(request_id="r3", node_id="b", model="tiny", route=FULL, prompt_tokens=3, completion_tokens=9,
                  resumed=4), []),
        (p.StatusRequest(), []),
        (p.Status({"nodes": [{"id": "a", "layers": [0, 2]}], "plans": {}, "x": None}), []),
        (p.AssignRequest("tiny", 30, max_layers=15), []),
        (p.Assign(0, 14), []),
        (p.Ack(ok=False, detail="already recorded: billed"), []),
        (p.Ack(probe=ROUTE), []),
        (p.Ack(detail="billed", request_id="r1"), []),
        (p.Leave("a"), []),
        (p.RelayOpen("a"), []),
        (p.RelayOpen("a", endpoint="tcp://relay:40001"), []),
        (p.RelayOpened("a", "tcp://relay:40001", key="k" * 40), []),
    ]


SAMPLES = samples()


def frames_of(kind: Kind | int, header, *buffers, magic: bytes = p.MAGIC) -> list:
    return [magic, bytes([kind]), msgpack.packb(header, use_bin_type=True), *buffers]


def header_of(message: p.Message, buffers=()) -> dict:
    return msgpack.unpackb(p.encode(message, buffers)[2])


def rejected(frames, code: str = BAD_FRAME, match: str | None = None, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        p.decode(frames, **kw)
    assert info.value.code == code, f"{info.value.code}: {info.value}"
    if match:
        assert re.search(match, str(info.value)), str(info.value)
    return info.value


# --------------------------------------------------------------------------- round trips


def test_samples_cover_every_kind():
    assert {type(m) for m, _ in SAMPLES} == set(p.MESSAGE_TYPES.values())
    assert set(p.MESSAGE_TYPES) == set(Kind)


def test_kind_codes_are_stable():
    # these numbers are on the wire: changing one is a protocol version bump
    assert {k.name: k.value for k in Kind} == {
        "FORWARD": 1, "TOKEN": 2, "CACHE_MISS": 3, "CANCEL": 4, "CLOSE": 5, "ERROR": 6, "PING": 7,
        "PONG": 8, "PROGRESS": 9, "GENERATE": 10, "EVENT": 11, "AUDIT_TAP": 12, "AUDIT": 13, "AUDIT_RESULT": 14,
        "REGISTER": 20, "HEARTBEAT": 21,
        "ROUTE_REQUEST": 22,
        "ROUTE": 23, "REPORT": 24, "STATUS_REQUEST": 25, "STATUS": 26, "ASSIGN_REQUEST": 27, "ASSIGN": 28,
        "ACK": 29, "RELAY_OPEN": 30, "RELAY_OPENED": 31, "LEAVE": 32, "REPLICAS_REQUEST": 33, "REPLICAS": 34,
        "VERDICT": 35, "MANIFEST_REQUEST": 36, "MANIFEST": 37, "CHUNK_REQUEST": 38, "CHUNK": 39,
        "FETCH_REPORT": 40}
    assert p.MAGIC == b"MESH1" and p.VERSION == 1


@pytest.mark.parametrize("message,buffers", SAMPLES, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in
                                                         enumerate(SAMPLES)])
def test_round_trip(message, buffers):
    frames = p.encode(message, buffers)
    assert frames[0] == p.MAGIC and frames[1] == bytes([message.KIND])
    assert len(frames) == 3 + len(buffers)
    decoded, out = p.decode(frames)
    assert decoded == message and type(decoded) is type(message)
    assert [bytes(b) for b in out] == [bytes(b) for b in buffers]
    # the same through plain bytes copies (what a non-zero-copy receiver hands over)
    again, out2 = p.decode([bytes(f) for f in frames])
    assert again == message and [bytes(b) for b in out2] == [bytes(b) for b in buffers]
    # and the header is canonical: re-encoding the decoded message gives the same bytes
    assert p.encode(decoded, out)[2] == frames[2]


def test_round_trip_over_a_socket_without_copy():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://test-protocol-pair")
        b.connect("inproc://test-protocol-pair")
        for message, buffers in SAMPLES:
            a.send_multipart(p.encode(message, buffers), copy=False)
            assert b.poll(2000)
            frames = b.recv_multipart(copy=False)  # zmq.Frame objects
            decoded, out = p.decode(frames)
            assert decoded == message
            if buffers:
                t = from_wire(decoded.tensors[0], out[0])
                frame_addr = np.frombuffer(frames[3].buffer, dtype=np.uint8).ctypes.data
                assert t.data_ptr() == frame_addr  # a tensor over the received frame: no copy
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_defaults_fill_omitted_fields_and_key_order_is_free():
    msg, _ = p.decode(frames_of(Kind.PONG, {"nonce": 3}))  # no "tensors" key at all
    assert msg == p.Pong(3, node="", sessions=0)
    spec, buf = _ids(1, 2)
    header = {"reply_to": "x", "route": [], "end_layer": 5, "start_layer": 0, "pos": 0, "step": 0,
              "session": "s", "tensors": [{"shape": [1, 2], "dtype": "int64"}]}
    msg, _ = p.decode(frames_of(Kind.FORWARD, header, buf))
    assert msg.sampling == Sampling() and msg.tensors == (spec,)
    msg, _ = p.decode(frames_of(Kind.GENERATE, {"request_id": "r", "route": [vars(HEAD)], "prompt": "x"}))
    assert (msg.max_tokens, msg.stop, msg.sampling, msg.messages, msg.api_key) == (256, (), Sampling(), None, None)


def test_ints_are_accepted_where_floats_are_expected():
    header = header_of(p.Route("tiny", FULL))
    header["estimated_tps"] = 3
    msg, _ = p.decode(frames_of(Kind.ROUTE, header))
    assert msg.estimated_tps == 3.0 and type(msg.estimated_tps) is float


def test_encode_needs_one_buffer_per_spec():
    message, buffers = _forward_ids()
    with pytest.raises(ValueError):
        p.encode(message)
    with pytest.raises(ValueError):
        p.encode(message, buffers * 2)


def test_split_envelope():
    body = p.encode(p.Ping(1))
    assert p.split_envelope([b"id", *body]) == ([b"id"], body)
    assert p.split_envelope([b"id", b"", *body]) == ([b"id", b""], body)
    assert p.split_envelope(body) == ([], body)
    with pytest.raises(ProtocolError):
        p.split_envelope([b"a", b"b", b"c", b"d", *body])
    with pytest.raises(ProtocolError):
        p.split_envelope([])


# --------------------------------------------------------------------------- tensors


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "float16": torch.float16, "int32": torch.int32}


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("name", list(DTYPES))
def test_tensor_round_trip_is_zero_copy(name):
    t = (torch.arange(24) - 7).reshape(1, 4, 6).to(DTYPES[name])
    spec, buf = to_wire(t)
    assert spec == TensorSpec(name, (1, 4, 6)) and buf.nbytes == spec.nbytes == t.numel() * t.element_size()
    assert _address(buf) == t.data_ptr()  # to_wire: a view of the tensor's own storage

    raw = bytearray(bytes(buf))
    out = from_wire(spec, memoryview(raw))
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
    assert out.data_ptr() == _address(raw)  # from_wire: a view of the received buffer
    raw[:] = bytes(len(raw))  # writes to the buffer show through the tensor
    assert not out.any()


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64"])
def test_tensor_zero_copy_through_encode_and_decode(name):
    t = torch.arange(16).reshape(1, 2, 8).to(DTYPES[name]) if name != "int64" else torch.arange(5).reshape(1, 5)
    spec, buf = to_wire(t)
    start = 0 if name == "int64" else 3
    message = p.Forward(session="s", step=0, pos=0, start_layer=start, end_layer=start, route=(),
                        reply_to="r", tensors=(spec,))
    frames = p.encode(message, [buf])
    decoded, out = p.decode(frames)
    received = from_wire(decoded.tensors[0], out[0])
    assert torch.equal(received, t)
    assert received.data_ptr() == t.data_ptr()  # in-process: the very same memory, end to end
    received_ro = from_wire(decoded.tensors[0], p.decode([bytes(f) for f in frames])[1][0])  # read-only bytes
    assert torch.equal(received_ro, t)


def test_wire_is_little_endian_c_contiguous():
    out = from_wire(TensorSpec("int64", (1, 3)), memoryview(struct.pack("<3q", 1, -2, 3)))
    assert out.tolist() == [[1, -2, 3]]
    out = from_wire(TensorSpec("float32", (2, 2)), memoryview(struct.pack("<4f", 1, 2, 3, 4)))
    assert out.tolist() == [[1, 2], [3, 4]]  # row-major
    assert bytes(to_wire(torch.tensor([1.0], dtype=torch.bfloat16))[1]) == b"\x80\x3f"
    assert bytes(to_wire(torch.tensor([1.0], dtype=torch.float16))[1]) == b"\x00\x3c"
    # a non-contiguous tensor goes out as its C-contiguous copy
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()
    spec, buf = to_wire(t)
    assert spec.shape == (3, 2) and torch.equal(from_wire(spec, buf), t)


def test_empty_tensor_and_from_wire_checks():
    spec, buf = to_wire(torch.empty(1, 0, 4))
    assert spec.nbytes == 0 and from_wire(spec, buf).shape == (1, 0, 4)
    with pytest.raises(ProtocolError):
        from_wire(TensorSpec("int64", (1, 3)), memoryview(bytes(23)))
    with pytest.raises(ProtocolError):
        from_wire(TensorSpec("float64", (1,)), memoryview(bytes(8)))
    with pytest.raises(ValueError):
        to_wire(torch.zeros(2, dtype=torch.float64))


# --------------------------------------------------------------------------- framing rejections


def test_too_few_frames():
    for frames in ([], [p.MAGIC], [p.MAGIC, b"\x07"]):
        rejected(frames, match="at least 3 frames")


@pytest.mark.parametrize("magic", [b"", b"MASH1", b"mesh1", b"XXXX1", b"\x00" * 5, b"MES"])
def test_wrong_magic(magic):
    rejected(frames_of(Kind.PING, {"nonce": 1}, magic=magic), BAD_FRAME, "bad magic")


@pytest.mark.parametrize("magic", [b"MESH2", b"MESH0", b"MESH9", b"MESH", b"MESH10"])
def test_other_version(magic):
    rejected(frames_of(Kind.PING, {"nonce": 1}, magic=magic), VERSION, "version")


@pytest.mark.parametrize("kind", [0, 15, 19, 41, 255])
def test_unknown_kind(kind):
    rejected(frames_of(kind, {"nonce": 1}), BAD_FRAME, "unknown message kind")


def test_a_batch_carries_messages_as_each_would_travel_alone():
    forward, buffers = next((m, b) for m, b in SAMPLES if isinstance(m, p.Forward) and m.start_layer)
    bodies = [p.encode(p.Ping(1)), p.encode(p.Token("s", 3, 7, 9)), p.encode(forward, buffers)]
    frames = p.encode_batch(bodies)
    assert [list(map(bytes, body)) for body in p.unbatch(frames)] == [list(map(bytes, b)) for b in bodies]
    assert [p.decode(body)[0] for body in p.unbatch(frames)][:2] == [p.Ping(1), p.Token("s", 3, 7, 9)]
    assert p.decode(p.unbatch(frames)[2])[0] == forward
    assert p.unbatch(bodies[0]) == [bodies[0]]  # any other message is itself
    rejected(frames, BAD_FRAME, "not one")  # read where a single message is: refused, never misread


@pytest.mark.parametrize("header, frames, match", [
    ({"counts": [3, 3]}, 5, "add up to 6 frames, but 5 follow"),
    ({"counts": []}, 0, "1-64 frame counts"),
    ({"counts": [3] * (p.MAX_BATCH + 1)}, 3 * (p.MAX_BATCH + 1), "1-64 frame counts"),
    ({"counts": [2, 4]}, 6, "of 3-11"),
    ({"counts": [3, 12]}, 15, "of 3-11"),
    ({"counts": [3], "more": 1}, 3, "header gives counts"),
    ({"counts": "3"}, 3, "header gives counts"),
])
def test_a_malformed_batch_is_refused_whole(header, frames, match):
    ping = p.encode(p.Ping(1))
    body = frames_of(p.BATCH_KIND, header, *(ping * (frames // 3)), *([b"x"] * (frames % 3)))
    with pytest.raises(ProtocolError, match=match) as info:
        p.unbatch(body)
    assert info.value.code == BAD_FRAME
    with pytest.raises(ProtocolError, match="version"):
        p.unbatch(frames_of(p.BATCH_KIND, {"counts": [3]}, *ping, magic=b"MESH2"))
    with pytest.raises(ValueError):
        p.encode_batch([ping] * (p.MAX_BATCH + 1))


@pytest.mark.parametrize("kind_frame", [b"", b"\x07\x00", b"\x00\x07", b"77"])
def test_kind_frame_must_be_one_byte(kind_frame):
    rejected([p.MAGIC, kind_frame, msgpack.packb({"nonce": 1})], BAD_FRAME, "one byte")


@pytest.mark.parametrize("header", [[1], 1, "nonce", None, b"\x80", True, 1.5])
def test_header_must_be_a_map(header):
    rejected(frames_of(Kind.PING, header), BAD_FRAME, "msgpack map")


@pytest.mark.parametrize("raw", [
    b"",  # empty
    b"\xc1",  # the one never-used msgpack byte
    b"\x81",  # map of one entry, truncated
    b"\x81\xa5nonce",  # value missing
    msgpack.packb({"nonce": 1}) + b"\x00",  # trailing data
    b"\x81\x01\x02",  # int map key (strict_map_key)
    b"\x81\xc0\x01",  # nil map key
    b"\xdf\xff\xff\xff\xff",  # map claiming 2**32-1 entries
    b"\xdb\x00\x10\x00\x01" + b"a" * 16,  # str longer than MAX_STRING
])
def test_bad_msgpack(raw):
    rejected([p.MAGIC, bytes([Kind.PING]), raw], BAD_FRAME)


def test_header_size_limit():
    rejected(frames_of(Kind.STATUS, {"body": {"x": "a" * p.MAX_HEADER_BYTES}}), BAD_FRAME, "header too large")


# --------------------------------------------------------------------------- field rejections


def _mutated(message, buffers, mutate):
    header = copy.deepcopy(header_of(message, buffers))
    mutate(header)
    return frames_of(message.KIND, header, *buffers)


def _set(path: str, value):
    """Mutation setting header[path] (dotted; integers index lists) to ``value``."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]

    def mutate(header):
        node = header
        for k in parents:
            node = node[k]
        node[last] = value
    return mutate


def _delete(path: str):
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]

    def mutate(header):
        node = header
        for k in parents:
            node = node[k]
        del node[last]
    return mutate


PING = (p.Ping(1), [])
REPORT = SAMPLES[[type(m) for m, _ in SAMPLES].index(p.Report)]
REGISTER = SAMPLES[[type(m) for m, _ in SAMPLES].index(p.Register)]
GENERATE = SAMPLES[[type(m) for m, _ in SAMPLES].index(p.Generate)]
EVENT = SAMPLES[[type(m) for m, _ in SAMPLES].index(p.Event)]
ERROR = SAMPLES[[type(m) for m, _ in SAMPLES].index(p.Error)]
HEARTBEAT = (p.Heartbeat("a", rtts={"b": 1.0}), [])
RELAYED = (p.Register(node_id="r", endpoint="tcp://relay:40001", model="tiny", fingerprint="f00d", num_layers=8,
                      start_layer=3, end_layer=7, relay="tcp://relay:5557", relay_key="k" * 40), [])
ACK = (p.Ack(probe=ROUTE), [])
RELAY_OPEN = (p.RelayOpen("a"), [])
RELAY_OPENED = (p.RelayOpened("a", "tcp://relay:40001"), [])
FWD = _forward_ids()
FWD_H = _forward_hidden()

FIELD_CASES = {
    # unknown fields
    "unknown top-level": (PING, _set("extra", 1), "unknown fields"),
    "KIND is no field": (PING, _set("KIND", 7), "unknown fields"),
    "unknown in hop": (FWD, _set("route.0.weight", 1), "unknown fields"),
    "unknown in sampling": (FWD, _set("sampling.min_p", 0.1), "unknown fields"),
    "bytes key": (PING, lambda h: h.__setitem__(b"nonce", 1), "unknown fields"),
    # missing required fields
    "missing nonce": (PING, _delete("nonce"), "missing field 'nonce'"),
    "missing session": (FWD, _delete("session"), "missing field 'session'"),
    "missing reply_to": (FWD, _delete("reply_to"), "missing field 'reply_to'"),
    "missing hop endpoint": (FWD, _delete("route.0.endpoint"), "missing field 'endpoint'"),
    "missing error code": (ERROR, _delete("code"), "missing field 'code'"),
    # wrong types
    "bool for int": (PING, _set("nonce", True), "must be an int"),
    "float for int": (PING, _set("nonce", 1.0), "must be an int"),
    "str for int": (PING, _set("nonce", "1"), "must be an int"),
    "nil for int": (PING, _set("nonce", None), "must be an int"),
    "bool for optional int": (ERROR, _set("step", False), "must be an int"),
    "bool for hop layer": (FWD, _set("route.0.start_layer", True), "must be an int"),
    "int for str": (FWD, _set("session", 5), "must be a str"),
    "bytes for str": (FWD, _set("session", b"s1"), "must be a str"),
    "map for list": (FWD, _set("route", {}), "must be a list"),
    "list for hop map": (FWD, _set("route.0", ["b", "e", 3, 5]), "must be a map"),
    "NaN float": (FWD, _set("sampling.temperature", math.nan), "finite number"),
    "inf float": (REPORT, _set("elapsed", math.inf), "finite number"),
    "-inf float": (REGISTER, _set("benchmark", -math.inf), "finite number"),
    "bool for float": (FWD, _set("sampling.top_p", True), "finite number"),
    "str for float": (FWD, _set("sampling.top_p", "1"), "finite number"),
    "int for bool": (REPORT, _set("final", 1), "must be a bool"),
    "list for dict": (REGISTER, _set("hardware", []), "must be a dict"),
    "str in list of dicts": (GENERATE, _set("messages", ["hi"]), "must be a dict"),
    "str in list of ints": (EVENT, _set("token_ids", [1, "2"]), "must be an int"),
    "str for list": (GENERATE, _set("stop", "\n"), "must be a list"),
    # typed maps and the fields added for relays and round trips
    "list for rtts": (HEARTBEAT, _set("rtts", [1.0]), "must be a map"),
    "str rtt": (HEARTBEAT, _set("rtts.b", "1"), "must be a finite number"),
    "bool rtt": (HEARTBEAT, _set("rtts.b", True), "must be a finite number"),
    "NaN rtt": (HEARTBEAT, _set("rtts.b", math.nan), "must be a finite number"),
    "bytes rtt key": (HEARTBEAT, lambda h: h["rtts"].__setitem__(b"x", 1.0), "key must be a str"),
    "int for relay": (REGISTER, _set("relay", 5), "must be a str"),
    "map for probe": (ACK, _set("probe", {}), "must be a list"),
    "unknown in probe hop": (ACK, _set("probe.0.via", 1), "unknown fields"),
    "missing relay node_id": (RELAY_OPEN, _delete("node_id"), "missing field 'node_id'"),
    "int for relay endpoint": (RELAY_OPENED, _set("endpoint", 1), "must be a str"),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_field_rejections(case):
    (message, buffers), mutate, match = FIELD_CASES[case]
    rejected(_mutated(message, buffers, mutate), BAD_FRAME, re.escape(match))


VALUE_CASES = {
    "negative rtt": (HEARTBEAT, _set("rtts.b", -1.0), r"must be in \[0, 600000\] ms"),
    "rtt over ten minutes": (HEARTBEAT, _set("rtts.b", 600_001), r"must be in \[0, 600000\] ms"),
    "empty rtt peer id": (HEARTBEAT, _set("rtts", {"": 1.0}), "1-256 characters"),
    "too many rtt peers": (HEARTBEAT, _set("rtts", {f"n{i}": 1.0 for i in range(p.MAX_RTT_PEERS + 1)}),
                           "at most 256 peers"),
    "too many probes": (ACK, _set("probe", [dict(node="x", endpoint="e", start_layer=0, end_layer=0)]
                                  * (p.MAX_PROBES + 1)), "at most 64 peers"),
    "negative kv_bytes": (HEARTBEAT, _set("kv_bytes", -1), "must be >= 0"),
    "negative kv_hits": (HEARTBEAT, _set("kv_hits", -1), "must be >= 0"),
    "relay_key without relay": (RELAYED, _set("relay", ""), "relay_key without relay"),
    "negative progress": ((p.Progress("s1", 2, "b", 5, 96), []), _set("done", -1), "done >= 0"),
    "progress past the layers": ((p.Progress("s1", 2, "b", 5, 96), []), _set("end_layer", p.MAX_LAYERS),
                                 "end_layer in range"),
    "empty relay node_id": (RELAY_OPEN, _set("node_id", ""), "1-256 characters"),
    "long relay endpoint": (RELAY_OPEN, _set("endpoint", "x" * 1025), "at most 1024"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_relay_and_rtt_value_rejections(case):
    (message, buffers), mutate, match = VALUE_CASES[case]
    rejected(_mutated(message, buffers, mutate), BAD_REQUEST if case == "relay_key without relay" else BAD_FRAME,
             match)


def _hop(start, end, node="x"):
    return {"node": node, "endpoint": "tcp://127.0.0.1:1", "start_layer": start, "end_layer": end}


def _tensor(dtype, shape):
    return _set("tensors", [{"dtype": dtype, "shape": shape}])


FORWARD_CASES = {
    "start after end": (FWD_H, [_set("start_layer", 6)], "out of range"),
    "end at MAX_LAYERS": (FWD_H, [_set("end_layer", p.MAX_LAYERS), _set("route", [])], "out of range"),
    "negative start": (FWD, [_set("start_layer", -1)], "out of range"),
    "negative pos": (FWD, [_set("pos", -1)], ">= 0"),
    "negative step": (FWD, [_set("step", -1)], ">= 0"),
    "route gap": (FWD, [_set("route", [_hop(4, 7)])], "starts at 4, expected 3"),
    "route overlap": (FWD, [_set("route", [_hop(2, 7)])], "starts at 2, expected 3"),
    "second hop gap": (FWD, [_set("route", [_hop(3, 4), _hop(6, 7)])], "starts at 6, expected 5"),
    "hop start after end": (FWD, [_set("route", [_hop(3, 2)])], "hop layers"),
    "hop past MAX_LAYERS": (FWD, [_set("route", [_hop(3, p.MAX_LAYERS)])], "hop layers"),
    "layer 0 with hidden states": (FWD_H, [_set("start_layer", 0)], "int64 input_ids"),
    "reuse at pos 0": (FWD, [_set("reuse", "s0")], "reuse needs pos > 0"),
    "reuse of itself": (FWD_H, [_set("reuse", "s1")], "another session's id"),
    "hidden states for layer 3 as ids": (FWD, [_set("start_layer", 1)], "float hidden states"),
    "tap id too long": (FWD, [_set("audit", "a" * (p.MAX_ID + 1))], "audit and reuse have at most"),
    "reuse id too long": (FWD_H, [_set("reuse", "r" * (p.MAX_ID + 1))], "audit and reuse have at most"),
    "session id too long": (FWD, [_set("session", "s" * (p.MAX_ID + 1))], f"session must have 1-{p.MAX_ID}"),
    "empty session id": (FWD, [_set("session", "")], f"session must have 1-{p.MAX_ID}"),
}


TAP, TAP_TAIL, AUDIT, AUDIT_RESULT = _audit_tap(), _audit_tap(tail=True), _audit(), _audit_result()
VERDICT = (p.Verdict("a", "tiny", "b", 3, 5, witnesses=("c", "d"), settled=True), [])
AUDIT_CASES = {
    "tap of layer 0": (TAP, _set("start_layer", 0), "0 < start <= end"),
    "tap with three tensors": ((dataclasses.replace(TAP[0], tensors=TAP[0].tensors * 3), TAP[1] * 3),
                               lambda h: None, "input's sketch"),
    "tail tap without logits": ((dataclasses.replace(TAP_TAIL[0], tensors=TAP_TAIL[0].tensors[:1]), TAP_TAIL[1][:1]),
                                lambda h: None, "a token comes with"),
    "tap input of ids": (TAP, _set("tensors.0.dtype", "int32"), "float32 sketch"),
    "tap sketch too wide": (TAP, _set("tensors.0.shape", [1, 3 * p.SKETCH_DIM]), "float32 sketch"),
    "tap output rows unlike the input's": (TAP_TAIL, _set("token", -1), "float32 sketch"),
    "empty tap id": (TAP, _set("tap", ""), "1-256 characters"),
    "empty tap session": (TAP, _set("session", ""), "1-256 characters"),
    "audit of layer 0 on hidden states": (AUDIT, _set("start_layer", 0), "int64 token ids"),
    "audit logits from past the input": (AUDIT, _set("logits_from", 3), "logits_from must be"),
    "audit input of batch 2": (AUDIT, _set("tensors.0.shape", [2, 3, 4]), "shape \\(1, q, hidden\\)"),
    "empty audit id": (AUDIT, _set("audit", ""), "1-256 characters"),
    "result with an error and a tensor": (AUDIT_RESULT, _set("error", "busy"), "one tensor, or none"),
    "result of too many logit rows": ((dataclasses.replace(AUDIT_RESULT[0], tensors=(_hidden(33, 2)[0],)),
                                       [_hidden(33, 2)[1]]), _set("tensors.0.shape", [33, 2]), "or logits"),
    "settled with one witness": (VERDICT, _set("witnesses", ["c"]), "at least two witnesses"),
    "settled with one witness twice": (VERDICT, _set("witnesses", ["c", "c"]), "at least two witnesses"),
    "suspect witnesses": (VERDICT, _set("witnesses", ["b", "c"]), "cannot witness against itself"),
    "head convicts itself": (VERDICT, _set("suspect", "a"), "cannot witness against itself"),
    "verdict on layer 0": (VERDICT, _set("start_layer", 0), "0 < start <= end"),
}


@pytest.mark.parametrize("case", list(AUDIT_CASES))
def test_audit_rejections(case):
    (message, buffers), mutate, match = AUDIT_CASES[case]
    rejected(_mutated(message, buffers, mutate), BAD_FRAME, match)


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_rejections(case):
    (message, buffers), mutations, match = FORWARD_CASES[case]

    def mutate(header):
        for m in mutations:
            m(header)
    rejected(_mutated(message, buffers, mutate), BAD_FRAME, match)


def test_forward_without_a_tensor():
    message, buffers = FWD
    frames = _mutated(message, buffers, _set("tensors", []))[:3]
    rejected(frames, BAD_FRAME, "exactly one tensor")


@pytest.mark.parametrize("start,dtype,shape,match", [
    (0, "int32", [1, 3], "int64 input_ids"),
    (0, "int64", [1, 3, 1], "int64 input_ids"),
    (3, "int64", [1, 3, 1], "float hidden states"),
    (3, "float32", [1, 24], "float hidden states"),
    (3, "int32", [1, 3, 2], "float hidden states"),
    (0, "int64", [3, 1], "batch 1"),
    (3, "float32", [2, 1, 12], "batch 1"),
    (0, "int64", [1, 0], "at least one token"),
])
def test_forward_tensor_shape_rejections(start, dtype, shape, match):
    nbytes = p.DTYPE_SIZES[dtype] * math.prod(shape)
    header = header_of(*_forward_ids())
    header.update(start_layer=start, end_layer=start + 2 if start else 2,
                  tensors=[{"dtype": dtype, "shape": shape}])
    if start:
        header["route"] = header["route"][1:]
    rejected(frames_of(Kind.FORWARD, header, bytes(nbytes)), BAD_FRAME, match)


def test_forward_carries_exactly_one_tensor():
    message, (buf,) = _forward_ids()
    header = header_of(message, [buf])
    header["tensors"] = header["tensors"] * 2
    rejected(frames_of(Kind.FORWARD, header, buf, buf), BAD_FRAME, "exactly one tensor")


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", 100.5), ("top_k", -1), ("top_k", 2**20 + 1),
    ("top_p", 0.0), ("top_p", 1.5), ("seed", -1), ("seed", 2**63),
])
def test_sampling_out_of_range_is_a_bad_request(field, value):
    rejected(_mutated(*FWD, _set(f"sampling.{field}", value)), BAD_REQUEST, field)
    rejected(_mutated(*GENERATE, _set(f"sampling.{field}", value)), BAD_REQUEST, field)


GENERATE_CASES = {
    "empty route": (_set("route", []), BAD_REQUEST, "needs a route"),
    "both prompt and messages": (_set("prompt", "x"), BAD_REQUEST, "exactly one of"),
    "neither prompt nor messages": (_delete("messages"), BAD_REQUEST, "exactly one of"),
    "route not at layer 0": (_set("route", [_hop(1, 7)]), BAD_REQUEST, "start at layer 0"),
    "max_tokens 0": (_set("max_tokens", 0), BAD_REQUEST, "max_tokens"),
    "max_tokens too large": (_set("max_tokens", 2**20 + 1), BAD_REQUEST, "max_tokens"),
    "empty stop string": (_set("stop", [""]), BAD_REQUEST, "stop"),
    "17 stop strings": (_set("stop", ["x"] * 17), BAD_REQUEST, "stop"),
    "message without role": (_set("messages", [{"content": "hi"}]), BAD_REQUEST, "role and content"),
    "message with int content": (_set("messages", [{"role": "user", "content": 1}]), BAD_REQUEST,
                                 "role and content"),
    # a gap in a GENERATE route is reported as bad_frame (Generate.validate uses the default code)
    "route gap": (_set("route", [_hop(0, 2), _hop(4, 7)]), BAD_FRAME, "starts at 4, expected 3"),
    "resume beyond max_tokens": (_set("resume", [1] * 17), BAD_REQUEST, "resume"),
    "negative resumed token id": (_set("resume", [-1]), BAD_REQUEST, "resume"),
    "resumed token id that is not an int": (_set("resume", ["a"]), BAD_FRAME, "resume must be an int"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_rejections(case):
    mutate, code, match = GENERATE_CASES[case]
    rejected(_mutated(*GENERATE, mutate), code, match)


# --------------------------------------------------------------------------- tensor spec rejections


@pytest.mark.parametrize("dtype", ["float64", "int8", "bool", "complex64", "", "FLOAT32", 5, None,
                                   b"float32"])
def test_dtype_not_allowed(dtype):
    spec, buf = _ids(1, 2)
    header = header_of(p.Forward("s", 0, 0, 0, 2, (), "r", tensors=(spec,)), [buf])
    header["tensors"][0]["dtype"] = dtype
    rejected(frames_of(Kind.FORWARD, header, buf), BAD_FRAME, "is not allowed")


@pytest.mark.parametrize("dtype", [["int64"], {"a": 1}])
def test_unhashable_dtype_is_a_protocol_error(dtype):
    rejected(frames_of(Kind.PING, {"nonce": 1, "tensors": [{"dtype": dtype, "shape": [1]}]}, bytes(8)))


@pytest.mark.parametrize("tensors,buffers,match", [
    ([{"dtype": "int64", "shape": [1, 3]}], [bytes(23)], "buffer has 23"),
    ([{"dtype": "int64", "shape": [1, 3]}], [bytes(25)], "buffer has 25"),
    ([{"dtype": "bfloat16", "shape": [1, 3, 4]}], [bytes(48)], "24 bytes"),
    ([{"dtype": "int64", "shape": [1, 3]}], [], "names 1 tensors but 0"),
    ([], [bytes(24)], "names 0 tensors but 1"),
    ([{"dtype": "int64", "shape": [1, 3]}], [bytes(24), bytes(24)], "names 1 tensors but 2"),
    ([{"dtype": "int64", "shape": "1,3"}], [bytes(24)], "shape must be"),
    ([{"dtype": "int64", "shape": []}], [bytes(8)], "shape must be"),
    ([{"dtype": "int64", "shape": [1, 1, 1, 1, 3]}], [bytes(24)], "shape must be"),
    ([{"dtype": "int64", "shape": [1, -3]}], [bytes(24)], "shape must be"),
    ([{"dtype": "int64", "shape": [1, True]}], [bytes(8)], "shape must be"),
    ([{"dtype": "int64", "shape": [1, 3.0]}], [bytes(24)], "shape must be"),
    ([{"dtype": "int64", "shape": [1, 2**31 + 1]}], [bytes(8)], "shape must be"),
    ([{"dtype": "int64", "shape": [1, 3], "strides": [3, 1]}], [bytes(24)], "exactly dtype and shape"),
    ([{"dtype": "int64"}], [bytes(24)], "exactly dtype and shape"),
    ([["int64", [1, 3]]], [bytes(24)], "exactly dtype and shape"),
    ({"dtype": "int64", "shape": [1, 3]}, [bytes(24)], "must be a list"),
    ("int64", [bytes(24)], "must be a list"),
])
def test_tensor_spec_rejections(tensors, buffers, match):
    header = header_of(p.Forward("s", 0, 0, 0, 2, (), "r", tensors=(TensorSpec("int64", (1, 3)),)),
                       [bytes(24)])
    header["tensors"] = tensors
    rejected(frames_of(Kind.FORWARD, header, *buffers), BAD_FRAME, re.escape(match))


def test_buffer_size_limits():
    spec, buf = _ids(1, 2, 3)  # 24 bytes
    frames = p.encode(p.Forward("s", 0, 0, 0, 2, (), "r", tensors=(spec,)), [buf])
    p.decode(frames, max_buffer_bytes=24)
    rejected(frames, BAD_FRAME, "exceeds the 23-byte limit", max_buffer_bytes=23)
    rejected(frames, BAD_FRAME, "exceeds the 0-byte limit", max_buffer_bytes=0)  # what the tracker uses
    # the limit is checked on the spec before the buffer: a lying 2 GiB spec costs nothing
    huge = {"nonce": 1, "tensors": [{"dtype": "float32", "shape": [1, 2**27 + 1]}]}
    rejected(frames_of(Kind.PING, huge, bytes(4)), BAD_FRAME, "exceeds the %d-byte limit" % p.MAX_BUFFER_BYTES)
    at_limit = {"nonce": 1, "tensors": [{"dtype": "float32", "shape": [1, 2**27]}]}
    rejected(frames_of(Kind.PING, at_limit, bytes(4)), BAD_FRAME, "buffer has 4")
    four_dims = {"nonce": 1, "tensors": [{"dtype": "int64", "shape": [2**31] * 4}]}
    rejected(frames_of(Kind.PING, four_dims, b""), BAD_FRAME, "exceeds")


def test_too_many_buffers():
    specs = [{"dtype": "int32", "shape": [1]}] * (p.MAX_BUFFERS + 1)
    rejected(frames_of(Kind.PING, {"nonce": 1, "tensors": specs}, *[bytes(4)] * (p.MAX_BUFFERS + 1)),
             BAD_FRAME, "at most 8")
    msg, bufs = p.decode(frames_of(Kind.PING, {"nonce": 1, "tensors": specs[:-1]}, *[bytes(4)] * p.MAX_BUFFERS))
    assert len(bufs) == p.MAX_BUFFERS == len(msg.tensors)


# --------------------------------------------------------------------------- fuzzing
#
# Whatever a peer sends, decode either returns a message or raises ProtocolError (with one
# of the documented codes). An accepted message must re-encode to a frame that decodes to
# the same header.

def check_decode(frames: list) -> None:
    try:
        message, buffers = p.decode(frames)
    except ProtocolError as exc:
        assert exc.code in CODES, exc.code
        event(f"rejected {exc.code}")
        return
    except Exception as exc:
        exc.add_note(f"frames: {frames!r}")
        raise
    event(f"accepted {type(message).__name__}")
    assert isinstance(message, p.MESSAGE_TYPES[Kind(bytes(frames[1])[0])])
    again = p.encode(message, buffers)
    message2, buffers2 = p.decode(again)
    assert p.encode(message2, buffers2)[2] == again[2]
    for spec, buf in zip(message.tensors, buffers):
        assert from_wire(spec, buf).numel() == math.prod(spec.shape)


FUZZ = settings(max_examples=2000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SAMPLE_FRAMES = [[bytes(f) for f in p.encode(m, b)] for m, b in SAMPLES]
FIELD_NAMES = sorted({f for cls in p.MESSAGE_TYPES.values() for f in cls.__dataclass_fields__}
                     | {"node", "endpoint", "start_layer", "end_layer", "temperature", "top_k", "top_p", "seed",
                        "dtype", "shape"})
INTERESTING = [0, 1, -1, 2, 3, 5, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), p.MAX_LAYERS, math.nan,
               math.inf, -math.inf, -0.0, 0.5, 1e308, "", "int64", "float32", "bfloat16", "float64", "x" * 300,
               [], [1], [1, 3], [1, 2, 8], [0], {}, b"", True, False, None, {"dtype": "int64", "shape": [1, 1]},
               {"node": "n", "endpoint": "e", "start_layer": 0, "end_layer": 0}]
KIND_BYTES = [bytes([k]) for k in Kind] + [b"\x00", b"\x09", b"\xff"]

# The strategies let hypothesis draw one seed and build or mutate frames with a plain
# Random: dozens of fine-grained hypothesis draws per example cost ~5 ms each, and the point
# here is volume, not shrinking (a failing example's frames are attached to its exception).

_SCALARS = [
    lambda r: r.choice(INTERESTING),
    lambda r: r.randint(-(2**63), 2**64 - 1),
    lambda r: r.randint(-3, 9),
    lambda r: r.choice([r.uniform(-1e6, 1e6), r.random(), math.nan, math.inf]),
    lambda r: "".join(chr(r.choice([r.randint(32, 126), r.randint(0xA0, 0xD7FF)])) for _ in range(r.randint(0, 6))),
    lambda r: r.randbytes(r.randint(0, 8)),
    lambda r: msgpack.ExtType(r.randint(0, 127), r.randbytes(r.randint(0, 4))),
    lambda r: r.choice(FIELD_NAMES),
]


def _value(r, depth: int = 0):
    """A random msgpack-encodable value: scalars, lists and maps nested up to 3 deep."""
    x = r.random()
    if depth < 3 and x < 0.12:
        return [_value(r, depth + 1) for _ in range(r.randint(0, 3))]
    if depth < 3 and x < 0.24:
        return {_key(r): _value(r, depth + 1) for _ in range(r.randint(0, 3))}
    return r.choice(_SCALARS)(r)


def _key(r):
    return r.choice(FIELD_NAMES) if r.random() < 0.7 else r.choice(["", "x", "KIND", "tensors", "\u00e9"])


def _mutate(node, r, depth: int = 0):
    """``node`` with one replace / delete / add somewhere at or below it."""
    if isinstance(node, (dict, list)) and node and depth < 4 and r.random() < 0.6:
        if isinstance(node, dict):  # descend into one value
            key = r.choice(list(node))
            return {**node, key: _mutate(node[key], r, depth + 1)}
        i = r.randrange(len(node))
        return [*node[:i], _mutate(node[i], r, depth + 1), *node[i + 1:]]
    op = r.choice(["replace", "delete", "add"]) if isinstance(node, (dict, list)) and node else "replace"
    if op == "replace":
        return _value(r)
    if op == "delete":
        if isinstance(node, dict):
            key = r.choice(list(node))
            return {k: v for k, v in node.items() if k != key}
        del_at = r.randrange(len(node))
        return node[:del_at] + node[del_at + 1:]
    if isinstance(node, dict):
        return {**node, _key(r): _value(r)}
    return [*node, r.choice([_value(r), r.choice(node)])]


@st.composite
def random_frames(draw) -> list:
    """Frame lists with a plausible prefix more often than chance would give one."""
    r = draw(st.randoms(use_true_random=True))
    magic = r.choice([p.MAGIC, p.MAGIC, p.MAGIC, b"MESH2", b"MESH", b"", r.randbytes(r.randint(0, 8))])
    kind = r.choice([r.choice(KIND_BYTES), r.choice(KIND_BYTES), r.randbytes(r.randint(0, 3))])
    if r.random() < 0.7:
        header = msgpack.packb(_value(r) if r.random() < 0.3 else {_key(r): _value(r) for _ in range(r.randint(0, 5))},
                               use_bin_type=True)
    else:
        header = r.randbytes(r.randint(0, 48))
    buffers = [r.randbytes(r.randint(0, 32)) for _ in range(r.choice([0, 0, 1, 2, r.randint(0, p.MAX_BUFFERS + 2)]))]
    frames = [magic, kind, header, *buffers]
    return frames[:r.randint(0, 2)] if r.random() < 0.1 else frames


@st.composite
def mutated_headers(draw) -> list:
    """A valid message whose header map got 1-4 mutations (replace/delete/add, at any depth)."""
    r = draw(st.randoms(use_true_random=True))
    message, buffers = r.choice(SAMPLES)
    header = header_of(message, buffers)
    for _ in range(r.randint(1, 4)):
        header = _mutate(header, r)
    buffers = [bytes(b) for b in buffers]
    if buffers and r.random() < 0.2:
        buffers = r.choice([[], buffers * 2, [buffers[0][:-1]], [buffers[0] + b"\x00"]])
    return frames_of(message.KIND, header, *buffers)


@st.composite
def flipped_frames(draw) -> list:
    """A valid message's frames with bytes flipped, inserted or cut, or frames dropped or doubled."""
    r = draw(st.randoms(use_true_random=True))
    frames = [bytearray(f) for f in r.choice(SAMPLE_FRAMES)]
    for _ in range(r.randint(1, 6)):
        if not frames:
            break
        i = r.randrange(len(frames)) if r.random() < 0.5 else min(2, len(frames) - 1)  # favour the header
        f = frames[i]
        op = r.choice(["flip", "flip", "flip", "insert", "cut", "drop", "dup"])
        if op == "flip" and f:
            f[r.randrange(len(f))] ^= r.randint(1, 255)
        elif op == "insert":
            at = r.randint(0, len(f))
            f[at:at] = r.randbytes(r.randint(1, 4))
        elif op == "cut" and f:
            at = r.randrange(len(f))
            del f[at:at + r.randint(1, 8)]
        elif op == "drop":
            del frames[i]
        elif op == "dup":
            frames.insert(i, bytearray(f))
    return [bytes(f) for f in frames]


@FUZZ
@given(random_frames())
def test_fuzz_random_frames(frames):
    check_decode(frames)


@FUZZ
@given(mutated_headers())
def test_fuzz_mutated_headers(frames):
    check_decode(frames)


@FUZZ
@given(flipped_frames())
def test_fuzz_flipped_bytes(frames):
    check_decode(frames)


# --------------------------------------------------------------------------- the document stays true


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_doc_lists_every_kind_and_error_code():
    doc = _doc()
    for kind in Kind:
        assert re.search(rf"\|\s*{kind.value}\s*\|\s*`{kind.name}`", doc), kind
    for code in CODES:
        assert f"`{code}`" in doc, code
    for name, size in p.DTYPE_SIZES.items():
        assert re.search(rf"`{name}`\s*\|\s*{size}", doc), name


def _doc_section(start: str, end: str) -> str:
    doc = _doc()
    a = doc.index(start)
    return doc[a:doc.index(end, a + len(start))]


def _field_names(cls) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if f.init and f.name != "tensors"]


def _table_fields(text: str) -> set[str]:
    """Field names in the first backquoted cell of table rows (after an optional kind cell)."""
    return set(re.findall(r"^\|(?:\s*[A-Z_]+\s*\|)?\s*`([a-z_]+)`\s*\|", text, re.M))


@pytest.mark.parametrize("cls", [Hop, Sampling, *p.MESSAGE_TYPES.values()], ids=lambda c: c.__name__)
def test_doc_field_tables_match_the_code(cls):
    """Each record's and message's table lists exactly its fields: a field added in the code
    (like Hop.key) fails here until the document describes it."""
    if cls is Hop:
        text = _doc_section("**Hop**", "**Sampling**")
    elif cls is Sampling:
        text = _doc_section("**Sampling**", "## 5.")
    else:
        kind = cls.KIND
        heading = re.search(rf"^### .*\b{kind.name} \({kind.value}\).*$", _doc(), re.M)
        assert heading, f"no section for {kind.name}"
        text = _doc_section(heading.group(0), "\n#")
        if not _field_names(cls):
            assert f"{kind.name} has no fields" in text
            return
        rows = [r for r in text.splitlines() if re.match(rf"^\|\s*{kind.name}\s*\|", r)]
        if rows:  # a table shared by two kinds: keep this kind's rows
            text = "\n".join(rows)
    documented = _table_fields(text) - {"tensors"}
    assert documented == set(_field_names(cls)), cls.__name__


def _doc_block(title: str) -> str:
    m = re.search(r"```[a-z]*\n" + re.escape(title) + r"\n(.*?)```", _doc(), re.S)
    assert m, f"no code block starting with {title!r} in {DOC}"
    return m.group(1)


def test_doc_worked_example_bytes():
    spec, buf = to_wire(torch.tensor([[1, 42]], dtype=torch.int64))
    message = p.Forward(session="s1", step=0, pos=0, start_layer=0, end_layer=2,
                        route=(Hop("b", "tcp://127.0.0.1:6001", 3, 5),), reply_to="tcp://127.0.0.1:6000",
                        sampling=Sampling(seed=7), tensors=(spec,))
    frames = p.encode(message, [buf])
    block = _doc_block("# frame 2: header")
    hexdump = "".join(re.sub(r"#.*", "", line) for line in block.splitlines())
    assert bytes.fromhex(hexdump) == frames[2]
    assert bytes.fromhex(re.sub(r"#.*", "", _doc_block("# frame 3: buffer 0").replace("\n", " "))) \
        == bytes(frames[3])


def test_doc_status_example_runs_against_a_tracker():
    from tracker.service import Tracker, TrackerConfig

    code = _doc_block("# status.py: ask a tracker for its status with pyzmq + msgpack only")
    stop = threading.Event()
    tracker = Tracker(TrackerConfig(bind="tcp://127.0.0.1:*", pub="tcp://127.0.0.1:*", db=":memory:"))
    thread = threading.Thread(target=tracker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert tracker.ready.wait(10)
        out = subprocess.run([sys.executable, "-c", code, tracker.endpoint], capture_output=True, text=True,
                             timeout=30, cwd="/")
        assert out.returncode == 0, out.stderr
        assert '"nodes": []' in out.stdout and '"protocol": 1' in out.stdout
    finally:
        stop.set()
        thread.join(10)
