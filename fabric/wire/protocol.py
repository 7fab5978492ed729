"""The meshnet wire protocol: one module owns every byte that crosses a socket.

A message is a ZeroMQ multipart message::

    [envelope ...] [MAGIC] [kind: 1 byte] [header: msgpack map] [buffer 0] ... [buffer n]

``MAGIC`` is ``b"MESH"`` followed by the protocol version as one ASCII digit. The header
is a msgpack map whose keys are the fields of the message's dataclass below; a message
that carries tensors lists them in ``header["tensors"]`` as ``{"dtype", "shape"}`` maps,
one per raw buffer frame that follows. Raw buffers are little-endian, C-contiguous.

Everything a peer sends is validated here and rejected with a typed ``ProtocolError``
(never an ``assert``). This module imports neither sockets nor torch.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, ClassVar, Sequence

import msgpack

VERSION = 1
MAGIC = b"MESH%d" % VERSION
MAGIC_PREFIX = b"MESH"

MAX_HEADER_BYTES = 1 << 20  # 1 MiB of msgpack is far more than any honest header needs
MAX_BUFFERS = 8
MAX_BATCH = 64  # messages one BATCH carries
BATCH_KIND = 16  # a BATCH's kind byte: several messages in one (``encode_batch``), not a message of its own
_BATCH_FRAME = bytes([BATCH_KIND])  # a BATCH's kind frame
MAX_BUFFER_BYTES = 512 << 20  # hard ceiling; nodes usually configure less
MAX_TENSOR_DIMS = 4
MAX_STRING = 1 << 20
MAX_LIST = 1 << 16
MAX_LAYERS = 4096
MAX_RTT_PEERS = 256  # peers a heartbeat may report round-trip times for
MAX_RTT_MS = 600_000.0  # ten minutes: anything slower is not a network
MAX_PROBES = 64  # peers the tracker may ask a node to measure in one answer

# One request's limits, the same from the web UI's body to the head's GENERATE: webui/schema.py,
# fabric.client and the head all check against these.
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_TOP_K = 1 << 20
MAX_SEED = (1 << 63) - 1
MAX_NEW_TOKENS = 1 << 20  # max_tokens
MAX_STOP = 4  # stop strings (OpenAI's limit)
MAX_MODEL_CHARS = 256
MAX_RESUME = MAX_LIST  # token ids a resumed GENERATE carries (at most its max_tokens, too)
MAX_TOKEN_ID = (1 << 31) - 1
MAX_SALT = 256  # characters of a cache_salt or an api_key
MAX_TOP_LOGPROBS = 20  # alternatives a token's logprobs list (OpenAI's top_logprobs limit)
MIN_LOGPROB = -9999.0  # a logprob below this (-inf: a masked token) travels as this, as vLLM reports it
MAX_PENALTY = 2.0  # presence and frequency penalties are in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0  # a logit_bias value is in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 300  # token ids one logit_bias may name (OpenAI's limit)
MAX_GRAMMAR = 64 << 10  # characters of a grammar's source (a JSON schema's text, a regex, a Lark grammar)
MAX_TOOLS = 128  # functions one request may offer (OpenAI's limit)
MAX_TOOLS_BYTES = 64 << 10  # their JSON text, all together: the head renders and compiles every byte
MAX_TOOL_NAME = 64  # characters of a function's name (OpenAI's limit)
MAX_TOOL_CALLS = 64  # tool_calls one assistant message of the history may carry

# dtype name -> item size in bytes. The receiver refuses anything else.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}  # uint8: raw bytes
WIRE_DTYPES = {"", "float32", "float16", "bfloat16"}  # hidden states on the wire; "": the compute dtype
FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # hidden states and logits
MAX_ID = 256  # longest id anywhere: session, request, audit, node, model, fingerprint
MAX_ENDPOINT = 1024  # longest endpoint (tcp://host:port, or a relay's)
TAP_ID_CHARS = 32  # a session's tap id (FORWARD.audit): secrets.token_hex(16), unguessable
SKETCH_DIM = 32  # numbers per position in an AUDIT_TAP's sketches (fabric/node/verdicts.py: ``sketch``)
MAX_AUDIT_LOGITS = 8  # positions whose logits one AUDIT_RESULT of a tail's layers carries (a replay's window)
MAX_CHUNK_BYTES = 4 << 20  # bytes of a model file one CHUNK carries
MAX_CHUNK_PARTS = MAX_BUFFERS  # tensors one CHUNK_REQUEST asks for (its first part, then whole ones): a buffer each
MAX_MANIFEST_BYTES = 16 << 20  # bytes of the manifest JSON one MANIFEST carries
MAX_TENSOR_NAME = 256  # characters of a tensor name in CHUNK_REQUEST (llama.cpp's limit is 64)
MAX_HOPS = 64  # hops of one route (a ROUTE's, a GENERATE's, the rest of a FORWARD's, a REPORT's)
MAX_EXCLUDE = 64  # node ids one ROUTE_REQUEST or REPLICAS_REQUEST asks the tracker to go around
# Deepest model the tracker plans for. The deepest public decoder stacks have ~126 layers
# (Llama 3.1 405B), so this is 8x headroom, while the wire's MAX_LAYERS (4096) would let one
# REGISTER make every plan, coverage map and assignment of that model 4096 layers long.
MAX_MODEL_LAYERS = 1024
MAX_BENCHMARK = 1e7  # layer-steps/s: a 0.1 us layer step; a larger claim would win every plan on its word
MAX_HARDWARE_KEYS = 16  # entries of REGISTER.hardware (nodes send 6); it is kept per node and shown in status
MAX_HARDWARE_KEY = 64  # characters of a hardware key
MAX_HARDWARE_TEXT = 256  # characters of a hardware value
MAX_REF = 64  # characters of a REPORT's ref (a head's attempt id) and of its finish_reason
MAX_COUNT = (1 << 31) - 1  # a REPORT's token counts
MAX_DRAFTS = 8  # drafted tokens one FORWARD may ask the tail to verify (the step then carries one more position)
MAX_DRAFT_Q = 64  # tokens of one drafted position's distribution (``DraftDist``) a FORWARD may carry


class ErrorCode:
    """Codes carried by ``Error.code``; clients switch on these, not on messages."""

    BAD_FRAME = "bad_frame"  # the frame failed validation
    VERSION = "version"  # the peer speaks another protocol version
    BAD_REQUEST = "bad_request"  # a well-formed message asks for something impossible
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_NODE = "unknown_node"  # tracker: heartbeat from a node it does not know; re-register
    NO_ROUTE = "no_route"
    BUSY = "busy"
    PROMPT_TOO_LONG = "prompt_too_long"
    INTERNAL = "internal"
    TRACKER_UNAVAILABLE = "tracker_unavailable"  # client side: the tracker did not answer in time
    TRACKER_STARTING = "tracker_starting"  # a tracker that just started has no route yet: its nodes still register
    HOP_FAILED = "hop_failed"
    CANCELLED = "cancelled"
    LEAVING = "leaving"  # the node is leaving the swarm (SIGTERM): it takes no new session; go around it


# a tracker's answer to ROUTE_REQUEST when it has no route (a head waits for its lost hops then)
NO_ROUTE_CODES = frozenset({ErrorCode.NO_ROUTE, ErrorCode.UNKNOWN_MODEL, ErrorCode.TRACKER_STARTING})
# the tracker cannot tell now: a client routes on what it remembers instead
TRACKER_AWAY_CODES = frozenset({ErrorCode.TRACKER_UNAVAILABLE, ErrorCode.TRACKER_STARTING})


class EventKind(StrEnum):
    """``Event.event``: what a head tells its client about a request."""

    START = "start"  # the route is set and the prompt counted
    TOKEN = "token"  # new text and the token ids it came from
    PROGRESS = "progress"  # the route prefills: no text yet, but no silence either (``prefilled`` of ``prefill_tokens``)
    DONE = "done"  # the end, with a finish reason and usage
    ERROR = "error"  # the end: the request failed (``error_code`` says how)


class FinishReason(StrEnum):
    """Why a request ended (``Event.finish_reason``, ``Report.finish_reason``)."""

    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client cancelled
    ERROR = "error"


class ProtocolError(Exception):
    """A peer sent something this protocol does not accept."""

    def __init__(self, message: str, code: str = ErrorCode.BAD_FRAME):
        super().__init__(message)
        self.code = code


def check_text(value: str | None, name: str, limit: int = MAX_ID, optional: bool = False,
               code: str = ErrorCode.BAD_FRAME) -> None:
    """The one check of an id or a short text a peer sends: 1 to ``limit`` characters (or
    None, if ``optional``). The tracker's registry and ledger use it with BAD_REQUEST."""
    if (value is None and optional) or (isinstance(value, str) and 0 < len(value) <= limit):
        return
    raise ProtocolError(f"{name} must have 1-{limit} characters", code)


class Kind(IntEnum):
    FORWARD = 1
    TOKEN = 2
    CACHE_MISS = 3
    CANCEL = 4
    CLOSE = 5
    ERROR = 6
    PING = 7
    PONG = 8
    PROGRESS = 9
    GENERATE = 10
    EVENT = 11
    AUDIT_TAP = 12
    AUDIT = 13
    AUDIT_RESULT = 14
    REGISTER = 20
    HEARTBEAT = 21
    ROUTE_REQUEST = 22
    ROUTE = 23
    REPORT = 24
    STATUS_REQUEST = 25
    STATUS = 26
    ASSIGN_REQUEST = 27
    ASSIGN = 28
    ACK = 29
    RELAY_OPEN = 30
    RELAY_OPENED = 31
    LEAVE = 32
    REPLICAS_REQUEST = 33
    REPLICAS = 34
    VERDICT = 35
    MANIFEST_REQUEST = 36
    MANIFEST = 37
    CHUNK_REQUEST = 38
    CHUNK = 39
    FETCH_REPORT = 40


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of one raw buffer frame."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Hop:
    """One step of a route: ``node`` runs layers ``start_layer..end_layer`` inclusive."""

    node: str
    endpoint: str
    start_layer: int
    end_layer: int
    key: str = ""  # the node's CURVE public key (z85) when the swarm is secured

    def validate(self) -> None:
        if not 0 <= self.start_layer <= self.end_layer < MAX_LAYERS:
            raise ProtocolError(f"hop layers {self.start_layer}-{self.end_layer} out of range")

    @property
    def host(self) -> str:
        """The host of ``endpoint``: hops with the same one run on one machine."""
        return endpoint_host(self.endpoint)


def endpoint_host(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> HOST."""
    return endpoint.split("://", 1)[-1].rsplit(":", 1)[0]


def check_chain(route: Sequence[Hop], start: int, code: str = ErrorCode.BAD_FRAME) -> None:
    """A route of at most MAX_HOPS hops, each starting where the one before it ended (the
    first at ``start``)."""
    if len(route) > MAX_HOPS:
        raise ProtocolError(f"a route has at most {MAX_HOPS} hops", code)
    expected = start
    for hop in route:
        if hop.start_layer != expected:
            raise ProtocolError(f"route hop starts at {hop.start_layer}, expected {expected}", code)
        expected = hop.end_layer + 1


@dataclass(frozen=True)
class Sampling:
    """How the tail turns logits into a token. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ProtocolError(f"temperature must be in [0, {MAX_TEMPERATURE:g}]", ErrorCode.BAD_REQUEST)
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise ProtocolError("top_k must be in [0, 2**20]", ErrorCode.BAD_REQUEST)
        if not (0.0 < self.top_p <= 1.0):
            raise ProtocolError("top_p must be in (0, 1]", ErrorCode.BAD_REQUEST)
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise ProtocolError("seed must be in [0, 2**63)", ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class DraftDist:
    """The distribution a draft model sampled one drafted token from: q over ``ids`` (every
    other token has q = 0), so the tail can apply the standard acceptance rule (keep the draft
    with min(1, p/q), else sample from norm(max(0, p - q)))."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]

    def validate(self) -> None:
        if not 1 <= len(self.ids) <= MAX_DRAFT_Q or len(self.probs) != len(self.ids):
            raise ProtocolError(f"a draft's distribution pairs 1 to {MAX_DRAFT_Q} ids with their probabilities")
        if len(set(self.ids)) != len(self.ids) or not all(0 <= t <= MAX_TOKEN_ID for t in self.ids):
            raise ProtocolError("a draft's distribution names each token id in [0, 2**31) once")
        if not all(0.0 <= q <= 1.0 for q in self.probs) or abs(sum(self.probs) - 1.0) > 1e-3:
            raise ProtocolError("a draft's probabilities are in [0, 1] and sum to 1")

    def prob(self, token: int) -> float:
        """q(token): 0 for a token the distribution does not name."""
        return self.probs[self.ids.index(token)] if token in self.ids else 0.0


@dataclass(frozen=True)
class Penalties:
    """OpenAI's presence and frequency penalties and logit_bias, which the tail applies to the
    logits before it samples: ``logit[j] += bias[j] - frequency * count[j] - presence * (count[j]
    > 0)``, ``count`` the times ``j`` was generated in this request (the prompt does not count)."""

    presence: float = 0.0
    frequency: float = 0.0
    bias_ids: tuple[int, ...] = ()  # token ids whose logits move by bias_values
    bias_values: tuple[float, ...] = ()
    generated: tuple[int, ...] = ()  # FORWARD: the tokens generated before this opening step (a re-prefill's)

    def validate(self) -> None:
        if not (abs(self.presence) <= MAX_PENALTY and abs(self.frequency) <= MAX_PENALTY):
            raise ProtocolError(f"presence and frequency penalties must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                                ErrorCode.BAD_REQUEST)
        if len(self.bias_ids) != len(self.bias_values) or len(self.bias_ids) > MAX_LOGIT_BIAS:
            raise ProtocolError(f"bias_ids and bias_values pair up, at most {MAX_LOGIT_BIAS} of them",
                                ErrorCode.BAD_REQUEST)
        if len(set(self.bias_ids)) != len(self.bias_ids) or not all(abs(b) <= MAX_BIAS for b in self.bias_values):
            raise ProtocolError(f"logit_bias names each token once, with a bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}]",
                                ErrorCode.BAD_REQUEST)
        if len(self.generated) > MAX_RESUME or not all(0 <= t <= MAX_TOKEN_ID for t in (*self.bias_ids,
                                                                                          *self.generated)):
            raise ProtocolError("token ids must be in [0, 2**31)", ErrorCode.BAD_REQUEST)


class GrammarKind(StrEnum):
    """What a ``Grammar``'s source is (``response_format``'s type, or vLLM's extension fields)."""

    JSON_OBJECT = "json_object"  # any JSON object; source ""
    JSON_SCHEMA = "json_schema"  # source: the schema, as JSON text
    REGEX = "regex"  # source: the pattern the whole reply matches (vLLM's guided_regex)
    LARK = "lark"  # source: a Lark grammar, as llguidance reads it (vLLM's guided_grammar)


@dataclass(frozen=True)
class Grammar:
    """What the reply must match: the tail masks every token the grammar forbids before it
    samples, and once the grammar is complete allows only end-of-sequence."""

    kind: str
    source: str = ""
    generated: tuple[int, ...] = ()  # FORWARD: the tokens generated before this opening step (a re-prefill's)

    def validate(self) -> None:
        if self.kind not in tuple(GrammarKind):
            raise ProtocolError(f"grammar kind must be one of {[k.value for k in GrammarKind]}", ErrorCode.BAD_REQUEST)
        if len(self.source) > MAX_GRAMMAR:
            raise ProtocolError(f"a grammar's source has at most {MAX_GRAMMAR} characters", ErrorCode.BAD_REQUEST)
        if (self.kind == GrammarKind.JSON_OBJECT) != (not self.source):
            raise ProtocolError("json_object has no source; every other grammar kind needs one", ErrorCode.BAD_REQUEST)
        if len(self.generated) > MAX_RESUME or not all(0 <= t <= MAX_TOKEN_ID for t in self.generated):
            raise ProtocolError("token ids must be in [0, 2**31)", ErrorCode.BAD_REQUEST)


class ToolChoice(StrEnum):
    """How the model may call the offered functions (OpenAI's ``tool_choice``)."""

    AUTO = "auto"  # free text; the reply is parsed for calls afterwards
    NONE = "none"  # no call: the template still shows the functions, nothing parses the reply
    REQUIRED = "required"  # one call or more, of any function: the reply is constrained to calls
    FUNCTION = "function"  # calls of ``Tools.name`` only, constrained likewise


@dataclass(frozen=True)
class Tools:
    """The functions a chat offers the model: the head renders them through the chat template
    and, for ``required`` or a named function, constrains the reply to calls with a grammar."""

    functions: tuple[dict, ...]  # OpenAI's tools array: {"type": "function", "function": {name, parameters...}}
    choice: str = ToolChoice.AUTO
    name: str = ""  # choice "function": the function to call
    parallel: bool = True  # several calls in one reply (OpenAI's parallel_tool_calls)

    @property
    def requires_call(self) -> bool:
        """"required" or a named function: the reply is calls, constrained by a grammar."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.FUNCTION)

    def validate(self) -> None:
        if not 1 <= len(self.functions) <= MAX_TOOLS:
            raise ProtocolError(f"tools lists 1 to {MAX_TOOLS} functions", ErrorCode.BAD_REQUEST)
        names = [function_name(tool) for tool in self.functions]
        if len(set(names)) != len(names):
            raise ProtocolError("tools names a function twice", ErrorCode.BAD_REQUEST)
        if len(json_text(self.functions)) > MAX_TOOLS_BYTES:
            raise ProtocolError(f"tools take at most {MAX_TOOLS_BYTES} bytes of JSON", ErrorCode.BAD_REQUEST)
        if self.choice not in tuple(ToolChoice):
            raise ProtocolError(f"tool_choice must be one of {[c.value for c in ToolChoice]}", ErrorCode.BAD_REQUEST)
        if (self.choice == ToolChoice.FUNCTION) != bool(self.name) or (self.name and self.name not in names):
            raise ProtocolError("tool_choice names a function of tools exactly when it is \"function\"",
                                ErrorCode.BAD_REQUEST)


_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,%d}" % MAX_TOOL_NAME)


def function_name(tool: Any) -> str:
    """The name of one entry of OpenAI's ``tools``, its shape checked: ``{"type": "function",
    "function": {"name", "description"?, "parameters"?, "strict"?}}``."""
    spec = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} \
            or not isinstance(spec, dict):
        raise ProtocolError('each tool is {"type": "function", "function": {...}}', ErrorCode.BAD_REQUEST)
    name = spec.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ProtocolError(f"a function's name is 1-{MAX_TOOL_NAME} letters, digits, _ or -", ErrorCode.BAD_REQUEST)
    if set(spec) - {"name", "description", "parameters", "strict"}:
        raise ProtocolError(f"function {name}: only name, description, parameters and strict", ErrorCode.BAD_REQUEST)
    if not isinstance(spec.get("description", ""), str) or not isinstance(spec.get("parameters", {}), dict) \
            or not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ProtocolError(f"function {name}: description is a string, parameters a JSON schema object",
                            ErrorCode.BAD_REQUEST)
    return name


def json_text(value: Any) -> str:
    """``value`` as compact JSON (what bounds are measured on); ProtocolError if it is not JSON."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"not JSON: {exc}"[:200], ErrorCode.BAD_REQUEST) from None


def check_message(m: Any) -> None:
    """One chat message as the head renders it: a string role; content a string, or null on an
    assistant message that carries ``tool_calls`` (OpenAI's shape: each {"id", "type":
    "function", "function": {"name", "arguments": JSON text}}); a tool message's
    ``tool_call_id`` a string."""
    if not isinstance(m.get("role"), str):
        raise ProtocolError("each message needs string role and content", ErrorCode.BAD_REQUEST)
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list) or not 1 <= len(calls) <= MAX_TOOL_CALLS:
            raise ProtocolError(f"tool_calls is a list of 1-{MAX_TOOL_CALLS} calls, on assistant messages only",
                                ErrorCode.BAD_REQUEST)
        for call in calls:
            _check_call(call)
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise ProtocolError("each message needs string role and content (null content only beside tool_calls)",
                            ErrorCode.BAD_REQUEST)
    if not isinstance(m.get("tool_call_id", ""), str) or not isinstance(m.get("name", ""), str):
        raise ProtocolError("a message's tool_call_id and name are strings", ErrorCode.BAD_REQUEST)


def _check_call(call: Any) -> None:
    spec = call.get("function") if isinstance(call, dict) else None
    ok = isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("arguments"), str) \
        and isinstance(call.get("id", ""), str) and call.get("type", "function") == "function"
    if not ok:
        raise ProtocolError('a tool call is {"id", "type": "function", "function": {"name", "arguments": '
                            '<JSON text>}}', ErrorCode.BAD_REQUEST)


def _check_logprob(value: float, what: str) -> None:
    if not MIN_LOGPROB <= value <= 0.0:
        raise ProtocolError(f"{what} must be in [{MIN_LOGPROB:g}, 0]", ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability and its text: the token decoded alone (as vLLM reports it: a
    piece of a multi-byte character decodes to U+FFFD)."""

    token: int
    text: str
    logprob: float

    def validate(self) -> None:
        _check_logprob(self.logprob, "logprob")


@dataclass(frozen=True)
class TokenLogprobs(Logprob):
    """A generated token's logprob, and the likeliest tokens at its position (``top``, likeliest first)."""

    top: tuple[Logprob, ...] = ()

    def validate(self) -> None:
        _check_logprob(self.logprob, "logprob")
        if len(self.top) > MAX_TOP_LOGPROBS:
            raise ProtocolError(f"top lists at most {MAX_TOP_LOGPROBS} tokens", ErrorCode.BAD_REQUEST)


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[Kind]
    # Fields left out of the header while they hold their default: a session that does not use
    # them pays no byte for them on a frame sent every token (the receiver fills in the default).
    SPARSE: ClassVar[frozenset[str]] = frozenset()
    # Tensor specs of the buffers that travel with the message (empty for most kinds).
    tensors: tuple[TensorSpec, ...] = field(default=(), kw_only=True)

    def validate(self) -> None:
        """Semantic checks beyond types; subclasses extend."""


@dataclass(frozen=True)
class Forward(Message):
    """Run layers start_layer..end_layer for a session, then pass along ``route``.

    Buffer 0 is ``input_ids`` (int64, (1, q)) when start_layer is 0, else hidden states
    ((1, q, hidden) in the wire dtype). ``pos`` is the sequence position of the first of
    the q tokens; pos 0 starts the session afresh on every hop (prefill or re-prefill).
    """

    KIND: ClassVar[Kind] = Kind.FORWARD
    SPARSE: ClassVar[frozenset[str]] = frozenset({"logprobs", "penalties", "grammar", "drafts", "draft_q", "guess"})
    session: str
    step: int
    pos: int
    start_layer: int
    end_layer: int
    route: tuple[Hop, ...]  # the hops after this one, in order
    reply_to: str  # endpoint of the head: TOKEN / CACHE_MISS / ERROR go there
    sampling: Sampling = Sampling()
    reply_key: str = ""  # the head's CURVE public key when the swarm is secured
    more: bool = False  # a prefill chunk that more chunks follow: the tail fills its KV, answers nothing
    wire_dtype: str = ""  # dtype of hidden states sent on from here; "": each node's compute dtype
    reuse: str = ""  # an ended session whose kept KV holds positions 0..pos-1: start from it; "": none
    audit: str = ""  # the session's tap id: every hop past the head answers each step with an AUDIT_TAP; "": none
    # on the steps that open the session (pos 0, or reuse): its TOKENs carry logprobs with this many
    # alternatives (0..MAX_TOP_LOGPROBS); -1: none, or (on other steps) as the opening step said
    logprobs: int = -1
    # on the steps that open the session: what the tail applies to the logits before sampling; None: nothing
    penalties: Penalties | None = None
    # on the steps that open the session: what the reply must match (``generated`` the tokens so far); None: free
    grammar: Grammar | None = None
    # a verification step: the last len(drafts) of its q positions hold these drafted tokens (q = len + 1); the
    # tail samples every position and answers a TOKEN per draft it would have sampled itself, plus the next one
    drafts: tuple[int, ...] = ()
    # a draft model's drafts, on a request that samples: the distribution each was drawn from (one per draft,
    # which it must give a probability > 0); (): each draft is a point mass (prompt lookup, a greedy draft)
    draft_q: tuple[DraftDist, ...] = ()
    # a verification step sent before the one ahead of it was answered (pipelined speculation): its first
    # position holds this guess of the token the tail samples there in that step, whose drafts it assumes
    # all kept; the tail runs it only where both held, and otherwise answers nothing (-1: not a guess)
    guess: int = -1

    def validate(self) -> None:
        if not -1 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ProtocolError(f"logprobs must be in [-1, {MAX_TOP_LOGPROBS}]")
        if not 0 <= self.start_layer <= self.end_layer < MAX_LAYERS:
            raise ProtocolError(f"layers {self.start_layer}-{self.end_layer} out of range")
        check_text(self.session, "session")
        if len(self.audit) > MAX_ID or len(self.reuse) > MAX_ID:
            raise ProtocolError(f"audit and reuse have at most {MAX_ID} characters")
        if self.pos < 0 or self.step < 0:
            raise ProtocolError("pos and step must be >= 0")
        if self.reuse and (self.pos == 0 or self.reuse == self.session):
            raise ProtocolError("reuse needs pos > 0 and another session's id")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ProtocolError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}")
        if len(self.tensors) != 1:
            raise ProtocolError("FORWARD carries exactly one tensor")
        spec = self.tensors[0]
        if self.start_layer == 0:
            if spec.dtype != "int64" or len(spec.shape) != 2:
                raise ProtocolError("FORWARD from layer 0 carries int64 input_ids of shape (1, q)")
        elif len(spec.shape) != 3 or spec.dtype not in ("float32", "float16", "bfloat16"):
            raise ProtocolError("FORWARD carries float hidden states of shape (1, q, hidden)")
        if spec.shape[0] != 1 or spec.shape[1] < 1:
            raise ProtocolError("FORWARD tensor must have batch 1 and at least one token")
        self._check_drafts(spec.shape[1])
        check_chain(self.route, self.end_layer + 1)

    def _check_drafts(self, q: int) -> None:
        """A verification step is a decode step and its drafts, nothing more: the tail's extra
        work (logits of len(drafts) + 1 positions) stays bounded by MAX_DRAFTS."""
        if len(self.draft_q) != (len(self.drafts) if self.draft_q else 0) or not all(
                dist.prob(t) > 0 for t, dist in zip(self.drafts, self.draft_q)):
            raise ProtocolError("draft_q gives one distribution per draft, each with the draft at a probability > 0")
        if not -1 <= self.guess <= MAX_TOKEN_ID or (self.guess >= 0 and not self.drafts):
            raise ProtocolError("guess is a token id in [0, 2**31) on a step with drafts, or -1")
        if not self.drafts:
            return
        if len(self.drafts) > MAX_DRAFTS or not all(0 <= t <= MAX_TOKEN_ID for t in self.drafts):
            raise ProtocolError(f"drafts holds at most {MAX_DRAFTS} token ids in [0, 2**31)")
        if q != len(self.drafts) + 1 or self.pos == 0 or self.more or self.reuse:
            raise ProtocolError("a step with drafts carries len(drafts) + 1 positions, at pos > 0, "
                                "neither a chunk that more follow nor one that reuses kept KV")


# What a node checks of a FORWARD against the model it holds (fabric/node/hops.py), and of a
# GENERATE (fabric/node/head.py): the same parts, with the model's numbers.


def check_route_end(msg: Forward, num_layers: int) -> None:
    """A FORWARD's layers end the model, or a hop follows; and its route reaches the last layer."""
    if msg.end_layer != num_layers - 1 and not msg.route:
        raise ProtocolError(f"layers end at {msg.end_layer} but no hop follows", ErrorCode.BAD_REQUEST)
    if msg.route and msg.route[-1].end_layer != num_layers - 1:
        raise ProtocolError("the route does not reach the last layer", ErrorCode.BAD_REQUEST)


def check_context(pos: int, count: int, context: int) -> None:
    """``count`` positions from ``pos`` fit the model's ``context`` (0: unchecked)."""
    if context and pos + count > context:
        raise ProtocolError(f"positions {pos}+{count} go past the model's context of {context}",
                            ErrorCode.BAD_REQUEST)


def check_hidden_size(got: int, hidden_size: int) -> None:
    if got != hidden_size:
        raise ProtocolError(f"hidden size {got} != {hidden_size}")


def check_vocab(ids: Sequence[int], vocab: int, what: str) -> None:
    """Token ids a peer names (layer 0's input_ids, a resume, a logit_bias) are ids of the
    model's ``vocab`` (0: unchecked): a bad one inside a batched pass would fail every
    session of the batch."""
    if vocab and ids and not 0 <= min(ids) <= max(ids) < vocab:
        raise ProtocolError(f"{what} holds a token id outside the vocabulary [0, {vocab})", ErrorCode.BAD_REQUEST)



@dataclass(frozen=True)
class Token(Message):
    """The tail's sampled token for ``step``; ``pos`` is the position it will occupy."""

    KIND: ClassVar[Kind] = Kind.TOKEN
    SPARSE: ClassVar[frozenset[str]] = frozenset({"logprob", "top_ids", "top_logprobs"})
    session: str
    step: int
    token: int
    pos: int
    # only for a session that asked (FORWARD.logprobs >= 0): the log-softmax of the raw logits
    # the token was sampled from, at ``token`` and at the likeliest ``top_ids``, likeliest first
    logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def validate(self) -> None:
        if self.logprob is None and self.top_ids:
            raise ProtocolError("top_ids come with a logprob")
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise ProtocolError(f"top_ids and top_logprobs pair up, at most {MAX_TOP_LOGPROBS} of them")
        if not all(0 <= t <= MAX_TOKEN_ID for t in (self.token, *self.top_ids)):
            raise ProtocolError("token ids must be in [0, 2**31)")
        lps = self.top_logprobs if self.logprob is None else (self.logprob, *self.top_logprobs)
        if not all(MIN_LOGPROB <= lp <= 0.0 for lp in lps):
            raise ProtocolError(f"logprobs must be in [{MIN_LOGPROB:g}, 0]")


@dataclass(frozen=True)
class CacheMiss(Message):
    """A hop was asked to continue a session whose KV it does not hold (``have`` tokens)."""

    KIND: ClassVar[Kind] = Kind.CACHE_MISS
    session: str
    step: int
    node: str
    have: int


@dataclass(frozen=True)
class Progress(Message):
    """A hop ran a prefill chunk of ``step`` (one that more chunks follow) and now holds the
    session's positions 0..done-1: the step is moving, however long its prompt."""

    KIND: ClassVar[Kind] = Kind.PROGRESS
    session: str
    step: int
    node: str
    end_layer: int  # the last layer the hop ran: which hop of the route it is
    done: int

    def validate(self) -> None:
        if self.step < 0 or self.done < 0 or not 0 <= self.end_layer < MAX_LAYERS:
            raise ProtocolError("PROGRESS needs step >= 0, done >= 0 and end_layer in range")


@dataclass(frozen=True)
class Cancel(Message):
    """Stop a session; ``route`` lists the hops after the receiver, which pass it on."""

    KIND: ClassVar[Kind] = Kind.CANCEL
    session: str
    route: tuple[Hop, ...] = ()


@dataclass(frozen=True)
class Close(Message):
    """The session ended normally: free its KV, pass along ``route``."""

    KIND: ClassVar[Kind] = Kind.CLOSE
    session: str
    route: tuple[Hop, ...] = ()


@dataclass(frozen=True)
class Error(Message):
    KIND: ClassVar[Kind] = Kind.ERROR
    code: str
    message: str
    session: str | None = None
    step: int | None = None
    node: str | None = None


@dataclass(frozen=True)
class Ping(Message):
    KIND: ClassVar[Kind] = Kind.PING
    nonce: int


@dataclass(frozen=True)
class Pong(Message):
    KIND: ClassVar[Kind] = Kind.PONG
    nonce: int
    node: str = ""
    sessions: int = 0


def key_id(api_key: str | None) -> str | None:
    """What travels and is stored of an API key: a truncated SHA-256 of it (an id is its own
    id). Clients send only this (fabric/client/core.py), so no head, tracker or ledger ever
    holds a key that would let it spend a tenant's quota elsewhere."""
    if not api_key:
        return None
    if api_key.startswith(KEY_ID_PREFIX) and len(api_key) == len(KEY_ID_PREFIX) + 16:
        return api_key
    return KEY_ID_PREFIX + hashlib.sha256(api_key.encode()).hexdigest()[:16]


KEY_ID_PREFIX = "sha256:"


@dataclass(frozen=True)
class Generate(Message):
    """Client -> head: generate for ``messages`` (chat) or ``prompt`` (raw) along ``route``."""

    KIND: ClassVar[Kind] = Kind.GENERATE
    SPARSE: ClassVar[frozenset[str]] = frozenset({"tools", "speculation"})
    request_id: str
    route: tuple[Hop, ...]
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    api_key: str | None = None  # who to bill: the key's id (``key_id``), never the key; reported to the tracker
    ignore_eos: bool = False  # generate max_tokens even past an end-of-sequence token (benchmarks)
    # token ids a head that died had streamed: this head takes them as its own and goes on after them
    resume: tuple[int, ...] = ()
    # prefix reuse is kept apart per (api_key, cache_salt): a request starts only from KV its own tenant left
    cache_salt: str = ""
    fit_context: bool = False  # max_tokens is a ceiling: the head lowers it to what the model's context leaves
    logprobs: int = -1  # token events carry logprobs with this many alternatives (0..MAX_TOP_LOGPROBS); -1: none
    penalties: Penalties | None = None  # presence/frequency penalties and logit_bias (``generated`` empty)
    grammar: Grammar | None = None  # what the reply must match (``generated`` empty); None: free text
    tools: Tools | None = None  # functions offered to a chat (``messages``); None: none
    # False: the head sends one token a step for this request, never drafts (True: as the head's --speculate says)
    speculation: bool = True

    def validate(self) -> None:
        if not -1 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ProtocolError(f"logprobs must be in [-1, {MAX_TOP_LOGPROBS}]", ErrorCode.BAD_REQUEST)
        if (self.messages is None) == (self.prompt is None):
            raise ProtocolError("GENERATE needs exactly one of messages or prompt", ErrorCode.BAD_REQUEST)
        if not self.route:
            raise ProtocolError("GENERATE needs a route", ErrorCode.BAD_REQUEST)
        if not 1 <= self.max_tokens <= MAX_NEW_TOKENS:
            raise ProtocolError("max_tokens must be in [1, 2**20]", ErrorCode.BAD_REQUEST)
        if len(self.stop) > MAX_STOP or any(not s for s in self.stop):
            raise ProtocolError(f"stop takes at most {MAX_STOP} non-empty strings", ErrorCode.BAD_REQUEST)
        resume_ok = len(self.resume) <= min(self.max_tokens, MAX_RESUME)
        if not resume_ok or not all(0 <= t <= MAX_TOKEN_ID for t in self.resume):
            raise ProtocolError("resume carries at most max_tokens token ids, each in [0, 2**31)",
                                ErrorCode.BAD_REQUEST)
        if len(self.cache_salt) > MAX_SALT or len(self.api_key or "") > MAX_SALT:
            raise ProtocolError(f"cache_salt and api_key take at most {MAX_SALT} characters", ErrorCode.BAD_REQUEST)
        for m in self.messages or ():
            check_message(m)
        if self.tools is not None and self.messages is None:
            raise ProtocolError("tools go with messages (a chat), not with a raw prompt", ErrorCode.BAD_REQUEST)
        if self.tools is not None and self.grammar is not None and self.tools.requires_call:
            raise ProtocolError("tool_choice: a required or named call is a grammar of its own; drop "
                                "response_format", ErrorCode.BAD_REQUEST)
        if self.route[0].start_layer != 0:
            raise ProtocolError("a route must start at layer 0", ErrorCode.BAD_REQUEST)
        check_chain(self.route, 0)


@dataclass(frozen=True)
class Event(Message):
    """Head -> client. ``event`` is "start", "token", "progress", "done" or "error"."""

    KIND: ClassVar[Kind] = Kind.EVENT
    SPARSE: ClassVar[frozenset[str]] = frozenset({"logprobs", "tool_syntax"})
    request_id: str
    event: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: str | None = None
    route: tuple[Hop, ...] = ()
    prefilled: int = 0  # progress: positions the route has prefilled, each hop weighed by its layers
    prefill_tokens: int = 0  # progress: positions the prefill reaches (the prompt; the history on a re-prefill)
    seed: int | None = None  # start: the sampling seed (the head draws one when the request names none)
    logprobs: tuple[TokenLogprobs, ...] = ()  # token, when the request asked: one per id of token_ids
    # start, when the request offers tools: how this head's template writes a call ("hermes",
    # "llama3", "mistral": fabric.toolcalls), which the client parses the reply by; "": no parsing
    tool_syntax: str = ""


@dataclass(frozen=True)
class Register(Message):
    KIND: ClassVar[Kind] = Kind.REGISTER
    node_id: str
    endpoint: str
    model: str
    fingerprint: str
    num_layers: int
    start_layer: int
    end_layer: int
    hardware: dict = field(default_factory=dict)
    benchmark: float = 0.0  # layer-steps per second on a fixed workload at start-up
    max_sessions: int = 0
    relay: str = ""  # control endpoint of the relay that ``endpoint`` (its front) belongs to; "": direct
    relay_key: str = ""  # the relay's CURVE public key: peers dial the front with it (secured swarms)

    def validate(self) -> None:
        if self.relay_key and not self.relay:
            raise ProtocolError("relay_key without relay", ErrorCode.BAD_REQUEST)


# What the tracker checks of the messages it keeps (tracker/registry.py, ledger.py, service.py):
# every refusal is BAD_REQUEST, answered to the sender.


def check_register(msg: Register) -> None:
    """A registration a route could use, and small enough to keep per node."""
    check_text(msg.node_id, "node_id", code=ErrorCode.BAD_REQUEST)
    check_text(msg.model, "model", code=ErrorCode.BAD_REQUEST)
    check_text(msg.fingerprint, "fingerprint", code=ErrorCode.BAD_REQUEST)
    check_text(msg.endpoint, "endpoint", MAX_ENDPOINT, code=ErrorCode.BAD_REQUEST)
    if len(msg.relay) > MAX_ENDPOINT or len(msg.relay_key) > MAX_ID:
        raise ProtocolError(f"relay has at most {MAX_ENDPOINT} characters, relay_key at most {MAX_ID}",
                            ErrorCode.BAD_REQUEST)
    _check_model_layers(msg.num_layers)
    if not 0 <= msg.start_layer <= msg.end_layer < msg.num_layers:
        raise ProtocolError(f"layers {msg.start_layer}-{msg.end_layer} are not inside 0-{msg.num_layers - 1}",
                            ErrorCode.BAD_REQUEST)
    if not 0 <= msg.benchmark <= MAX_BENCHMARK or msg.max_sessions < 0:
        raise ProtocolError(f"benchmark must be in [0, {MAX_BENCHMARK:g}] and max_sessions >= 0",
                            ErrorCode.BAD_REQUEST)
    _check_hardware(msg.hardware)


def _check_model_layers(num_layers: int) -> None:
    if not 1 <= num_layers <= MAX_MODEL_LAYERS:
        raise ProtocolError(f"num_layers {num_layers} is not in [1, {MAX_MODEL_LAYERS}]", ErrorCode.BAD_REQUEST)


def _check_hardware(hardware: dict) -> None:
    """A small flat map of short scalars: the tracker keeps it per node and every status shows it."""
    if len(hardware) > MAX_HARDWARE_KEYS:
        raise ProtocolError(f"hardware has at most {MAX_HARDWARE_KEYS} entries", ErrorCode.BAD_REQUEST)
    for key, value in hardware.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_HARDWARE_KEY:
            raise ProtocolError(f"hardware keys are 1-{MAX_HARDWARE_KEY} characters", ErrorCode.BAD_REQUEST)
        if isinstance(value, str) and len(value) > MAX_HARDWARE_TEXT:
            raise ProtocolError(f"hardware[{key!r}] has more than {MAX_HARDWARE_TEXT} characters",
                                ErrorCode.BAD_REQUEST)
        if value is not None and not isinstance(value, (str, int, float)):
            raise ProtocolError(f"hardware[{key!r}] must be a string or a number", ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class Heartbeat(Message):
    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    node_id: str
    sessions: int = 0
    queued: int = 0
    rtts: dict[str, float] = field(default_factory=dict)  # peer node id -> smoothed round trip, ms
    kv_bytes: int = 0  # bytes of ended sessions' KV kept for reuse
    kv_hits: int = 0  # requests that started from kept KV here, since the node started
    kv_misses: int = 0  # requests that asked for kept KV this node no longer held

    def validate(self) -> None:
        if min(self.kv_bytes, self.kv_hits, self.kv_misses) < 0:
            raise ProtocolError("kv_bytes, kv_hits and kv_misses must be >= 0")
        if len(self.rtts) > MAX_RTT_PEERS:
            raise ProtocolError(f"rtts lists at most {MAX_RTT_PEERS} peers")
        for peer, ms in self.rtts.items():
            check_text(peer, "an rtts peer id")
            if not 0.0 <= ms <= MAX_RTT_MS:
                raise ProtocolError(f"rtts[{peer!r}] must be in [0, {MAX_RTT_MS:.0f}] ms")


def check_heartbeat(msg: Heartbeat) -> None:
    check_text(msg.node_id, "node_id", code=ErrorCode.BAD_REQUEST)
    if msg.sessions < 0 or msg.queued < 0:
        raise ProtocolError("sessions and queued must be >= 0", ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class RouteRequest(Message):
    KIND: ClassVar[Kind] = Kind.ROUTE_REQUEST
    model: str
    exclude: tuple[str, ...] = ()

    def validate(self) -> None:
        """The tracker books both in its event ring (shown in every status): ids, few of them."""
        check_text(self.model, "model", code=ErrorCode.BAD_REQUEST)
        if len(self.exclude) > MAX_EXCLUDE:
            raise ProtocolError(f"exclude lists at most {MAX_EXCLUDE} node ids", ErrorCode.BAD_REQUEST)
        for node in self.exclude:
            check_text(node, "an excluded node id", code=ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class Route(Message):
    KIND: ClassVar[Kind] = Kind.ROUTE
    model: str
    hops: tuple[Hop, ...]
    estimated_tps: float = 0.0

    def validate(self) -> None:
        check_chain(self.hops, 0)


@dataclass(frozen=True)
class Report(Message):
    """Head -> tracker: progress (``final`` false) or completion of a request."""

    KIND: ClassVar[Kind] = Kind.REPORT
    SPARSE: ClassVar[frozenset[str]] = frozenset({"trips", "drafted", "kept"})
    request_id: str
    node_id: str
    model: str
    route: tuple[Hop, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed: float = 0.0
    final: bool = False
    finish_reason: str | None = None
    api_key: str | None = None
    max_tokens: int = 0
    prefilled: int = 0  # as EVENT's: how far the running prefill has come (0 with prefill_tokens 0: none runs)
    prefill_tokens: int = 0
    resumed: int = 0  # of completion_tokens, those a head that died streamed before this one took over
    ref: str = ""  # the head's own id for this attempt at the request: the ledger's key ("": request_id)
    # speculation (0 where the head drafts nothing for it): decode steps answered so far (a trip through the
    # route each), the drafts they carried, and those the tail kept; tokens per trip = (trips + kept) / trips
    trips: int = 0
    drafted: int = 0
    kept: int = 0

    @property
    def billing_id(self) -> str:
        """What the ledger keys this report by: the head's ``ref``, else (an older head) the request id."""
        return self.ref or self.request_id


def check_report(report: Report) -> None:
    """A report the ledger can trust (tracker/reports.py, tracker/ledger.py)."""
    check_text(report.request_id, "request_id", code=ErrorCode.BAD_REQUEST)
    if report.ref:
        check_text(report.ref, "ref", MAX_REF, code=ErrorCode.BAD_REQUEST)
    check_text(report.node_id, "node_id", code=ErrorCode.BAD_REQUEST)
    check_text(report.model, "model", code=ErrorCode.BAD_REQUEST)
    check_text(report.finish_reason, "finish_reason", MAX_REF, optional=True, code=ErrorCode.BAD_REQUEST)
    check_text(report.api_key, "api_key", MAX_SALT, optional=True, code=ErrorCode.BAD_REQUEST)
    counts = (report.prompt_tokens, report.completion_tokens, report.max_tokens, report.prefilled,
              report.prefill_tokens)
    if any(not 0 <= c <= MAX_COUNT for c in counts) or report.elapsed < 0:
        raise ProtocolError("token counts and elapsed must be >= 0", ErrorCode.BAD_REQUEST)
    if not 0 <= report.resumed <= report.completion_tokens:
        raise ProtocolError("resumed must be in [0, completion_tokens]", ErrorCode.BAD_REQUEST)
    if not (0 <= report.kept <= report.drafted <= MAX_COUNT and 0 <= report.trips <= MAX_COUNT
            and report.kept <= report.trips * MAX_DRAFTS):
        raise ProtocolError("trips, drafted and kept must be >= 0, kept <= drafted and kept <= 8 a trip",
                            ErrorCode.BAD_REQUEST)
    check_chain(report.route, 0, ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class StatusRequest(Message):
    KIND: ClassVar[Kind] = Kind.STATUS_REQUEST


@dataclass(frozen=True)
class Status(Message):
    KIND: ClassVar[Kind] = Kind.STATUS
    body: dict


@dataclass(frozen=True)
class AssignRequest(Message):
    """A node without --layers asks which span to hold."""

    KIND: ClassVar[Kind] = Kind.ASSIGN_REQUEST
    model: str
    num_layers: int
    max_layers: int = 0  # how many layers fit this node's memory budget; 0: all


def check_assign_request(msg: AssignRequest) -> None:
    check_text(msg.model, "model", code=ErrorCode.BAD_REQUEST)
    _check_model_layers(msg.num_layers)
    if msg.max_layers < 0:
        raise ProtocolError("max_layers must be >= 0", ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class Assign(Message):
    KIND: ClassVar[Kind] = Kind.ASSIGN
    start_layer: int
    end_layer: int


@dataclass(frozen=True)
class Ack(Message):
    KIND: ClassVar[Kind] = Kind.ACK
    ok: bool = True
    detail: str = ""
    probe: tuple[Hop, ...] = ()  # answer to a heartbeat: peers whose round trip the node should measure
    reachable: bool = True  # answer to a heartbeat: False when the tracker could not reach the node's endpoint
    request_id: str = ""  # answer to a final report: its request id (the node stops sending it again)

    def validate(self) -> None:
        if len(self.probe) > MAX_PROBES:
            raise ProtocolError(f"probe lists at most {MAX_PROBES} peers")
        if len(self.request_id) > MAX_ID:
            raise ProtocolError(f"request_id has at most {MAX_ID} characters")


@dataclass(frozen=True)
class Leave(Message):
    """Node -> tracker: this node is leaving (SIGTERM). The tracker drops it from plans at once;
    the node finishes the sessions it serves, takes no new one, and sends no more heartbeats."""

    KIND: ClassVar[Kind] = Kind.LEAVE
    node_id: str

    def validate(self) -> None:
        check_text(self.node_id, "node_id")


@dataclass(frozen=True)
class RelayOpen(Message):
    """Node -> relay control socket: open (or keep open) a public front for ``node_id``.

    Sent every keepalive interval; ``endpoint`` is the front the node had before (a
    restarted relay binds the same port again when it can), "" at first.
    """

    KIND: ClassVar[Kind] = Kind.RELAY_OPEN
    node_id: str
    endpoint: str = ""

    def validate(self) -> None:
        check_text(self.node_id, "node_id")
        if len(self.endpoint) > MAX_ENDPOINT:
            raise ProtocolError(f"endpoint has at most {MAX_ENDPOINT} characters")


@dataclass(frozen=True)
class RelayOpened(Message):
    """Relay -> node: the front peers reach ``node_id`` at, and the key they dial it with."""

    KIND: ClassVar[Kind] = Kind.RELAY_OPENED
    node_id: str
    endpoint: str
    key: str = ""  # the relay's CURVE public key (z85) in a secured swarm


# --------------------------------------------------------------------------- audits


def _check_span(start: int, end: int) -> None:
    """An audited span: never the head's (layer 0 takes token ids, and the head trusts itself)."""
    if not 0 < start <= end < MAX_LAYERS:
        raise ProtocolError(f"audited layers {start}-{end} must satisfy 0 < start <= end < {MAX_LAYERS}")


def _check_hidden(spec: TensorSpec, what: str) -> None:
    if spec.dtype not in FLOAT_DTYPES or len(spec.shape) != 3 or spec.shape[0] != 1 or spec.shape[1] < 1:
        raise ProtocolError(f"{what} is float hidden states of shape (1, q, hidden)")


def _check_sketch(spec: TensorSpec, rows: int, what: str) -> None:
    if spec.dtype != "float32" or tuple(spec.shape) != (rows, SKETCH_DIM):
        raise ProtocolError(f"{what} is a float32 sketch of shape ({rows}, {SKETCH_DIM})")


@dataclass(frozen=True)
class AuditTap(Message):
    """Hop -> head, after every step a FORWARD with an ``audit`` tap id asked of it: sketches
    of what it received and computed (the head keeps those of the sessions it audits, and
    drops the rest). Buffer 0 sketches the input, one row per position pos..pos+q-1; buffer 1
    the output: one row per position (hidden states), or one row of the logits of the last
    position on the tail; none on the tail for a prefill chunk that more follow. Who sent it
    is the transport's word (the tap id, and in a CURVE swarm the sender's key), never a field."""

    KIND: ClassVar[Kind] = Kind.AUDIT_TAP
    tap: str  # the FORWARD's ``audit``, echoed: it answers that session's head and nobody else
    session: str
    step: int
    pos: int  # the position of the input's first row
    start_layer: int
    end_layer: int
    token: int = -1  # on the tail, the token it sampled from the logits it sketched; -1: none

    def validate(self) -> None:
        check_text(self.tap, "tap")
        check_text(self.session, "session")
        _check_span(self.start_layer, self.end_layer)
        if self.step < 0 or self.pos < 0 or not -1 <= self.token <= MAX_TOKEN_ID:
            raise ProtocolError("step and pos must be >= 0 and token a token id or -1")
        if len(self.tensors) not in (1, 2):
            raise ProtocolError("AUDIT_TAP carries the input's sketch and, but for a tail's chunk, the output's")
        q = self.tensors[0].shape[0] if self.tensors[0].shape else 0
        if not 1 <= q <= MAX_LIST:
            raise ProtocolError(f"AUDIT_TAP sketches 1-{MAX_LIST} positions")
        _check_sketch(self.tensors[0], q, "AUDIT_TAP's input")
        if len(self.tensors) == 2:
            _check_sketch(self.tensors[1], 1 if self.token >= 0 else q, "AUDIT_TAP's output")
        elif self.token >= 0:
            raise ProtocolError("a token comes with the sketch of the logits it was sampled from")


@dataclass(frozen=True)
class Audit(Message):
    """Head -> a node holding the layers (a replica, or the head itself for its own span):
    run start_layer..end_layer on buffer 0 from position 0 in a session of its own, then
    answer AUDIT_RESULT ``audit`` at ``reply_to``. Buffer 0 is token ids (1, q) int64 at
    layer 0, else hidden states (1, q, hidden). On a span that ends at the model's last
    layer the answer is the logits of positions logits_from..q-1 (the last one with -1)."""

    KIND: ClassVar[Kind] = Kind.AUDIT
    audit: str  # unguessable, one per replica asked: only the answer that echoes it counts
    start_layer: int
    end_layer: int
    reply_to: str
    reply_key: str = ""  # the head's CURVE public key when the swarm is secured
    logits_from: int = -1  # a tail's span: the first position whose logits the answer carries; -1: the last

    def validate(self) -> None:
        check_text(self.audit, "audit")
        if not 0 <= self.start_layer <= self.end_layer < MAX_LAYERS:
            raise ProtocolError(f"audited layers {self.start_layer}-{self.end_layer} out of range")
        if len(self.tensors) != 1:
            raise ProtocolError("AUDIT carries exactly one tensor: the input")
        spec = self.tensors[0]
        if self.start_layer == 0:
            if spec.dtype != "int64" or len(spec.shape) != 2 or spec.shape[0] != 1 or spec.shape[1] < 1:
                raise ProtocolError("AUDIT from layer 0 carries int64 token ids of shape (1, q)")
        else:
            _check_hidden(spec, "AUDIT's input")
        q = spec.shape[1]
        if self.logits_from != -1 and not (0 <= self.logits_from < q and q - self.logits_from <= MAX_AUDIT_LOGITS):
            raise ProtocolError(f"logits_from must be -1 or one of the last {MAX_AUDIT_LOGITS} of the q positions")


@dataclass(frozen=True)
class AuditResult(Message):
    """Node -> head: the output of AUDIT ``audit`` (buffer 0: hidden states (1, q, hidden), or
    logits (n, vocab) of a tail's span), or ``error``. Who computed it is the transport's word."""

    KIND: ClassVar[Kind] = Kind.AUDIT_RESULT
    audit: str
    error: str = ""  # why the node computed nothing; "": one tensor follows

    def validate(self) -> None:
        check_text(self.audit, "audit")
        if len(self.error) > 1024:
            raise ProtocolError("error has at most 1024 characters")
        if len(self.tensors) != (0 if self.error else 1):
            raise ProtocolError("AUDIT_RESULT carries one tensor, or none with an error")
        if self.tensors:
            spec = self.tensors[0]
            logits = len(spec.shape) == 2 and spec.dtype in FLOAT_DTYPES and 1 <= spec.shape[0] <= MAX_AUDIT_LOGITS
            if not logits:
                _check_hidden(spec, "AUDIT_RESULT's output (or logits (n, vocab))")


@dataclass(frozen=True)
class ReplicasRequest(Message):
    """Head -> tracker: which nodes could re-run layers start..end of ``model`` with these
    weights, instead of ``suspect``. The tracker remembers whom it named to which head: a
    VERDICT may only cite those."""

    KIND: ClassVar[Kind] = Kind.REPLICAS_REQUEST
    audit: str
    model: str
    fingerprint: str
    start_layer: int
    end_layer: int
    exclude: tuple[str, ...] = ()
    node_id: str = ""  # the asking head (in a secured swarm, bound to the key it registered with)
    suspect: str = ""  # the node whose work is checked; the answer gives the key the tracker lists for it

    def validate(self) -> None:
        check_text(self.audit, "audit")
        check_text(self.model, "model")
        check_text(self.fingerprint, "fingerprint")
        _check_span(self.start_layer, self.end_layer)
        if len(self.node_id) > MAX_ID or len(self.suspect) > MAX_ID or len(self.exclude) > MAX_EXCLUDE:
            raise ProtocolError(f"node_id and suspect have at most {MAX_ID} characters, exclude {MAX_EXCLUDE} ids")


@dataclass(frozen=True)
class Replicas(Message):
    """Tracker -> head: the answer to REPLICAS_REQUEST ``audit``; each hop runs exactly the asked layers."""

    KIND: ClassVar[Kind] = Kind.REPLICAS
    audit: str
    hops: tuple[Hop, ...] = ()
    suspect_key: str = ""  # the CURVE key the tracker lists for the suspect ("" in plaintext, or unknown)


@dataclass(frozen=True)
class Verdict(Message):
    """Head -> tracker: an audit found ``suspect``'s output on layers start..end wrong."""

    KIND: ClassVar[Kind] = Kind.VERDICT
    node_id: str  # the head that audited
    model: str
    suspect: str
    start_layer: int
    end_layer: int
    witnesses: tuple[str, ...] = ()  # settled: two replicas the tracker named to this head, agreeing against it
    settled: bool = False  # True: two agree against the suspect, exclude it; False: a mismatch nobody settled
    detail: str = ""  # how far apart the outputs were

    def validate(self) -> None:
        for value, name in ((self.node_id, "node_id"), (self.model, "model"), (self.suspect, "suspect")):
            check_text(value, name)
        _check_span(self.start_layer, self.end_layer)
        if self.suspect in self.witnesses or self.suspect == self.node_id:
            raise ProtocolError("a suspect cannot witness against itself or be the auditing head")
        if self.settled and len(set(self.witnesses)) < 2:
            raise ProtocolError("a settled VERDICT names at least two witnesses")
        if len(self.detail) > 1024 or len(self.witnesses) > 8:
            raise ProtocolError("detail has at most 1024 characters and witnesses at most 8 nodes")


# --------------------------------------------------------------------------- weights from peers


def _check_digest(value: str, name: str) -> None:
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ProtocolError(f"{name} must be 64 lowercase hex digits (a sha256)", ErrorCode.BAD_REQUEST)


def _check_bytes_buffer(message: Message, limit: int, what: str, parts: int = 1) -> None:
    """``message`` carries 1 to ``parts`` buffers of uint8 bytes, shape (n,), ``limit`` bytes in all."""
    if not 1 <= len(message.tensors) <= parts:
        raise ProtocolError(f"{what} carries exactly one buffer" if parts == 1 else f"{what} carries 1-{parts} buffers")
    if (any(spec.dtype != "uint8" or len(spec.shape) != 1 for spec in message.tensors)
            or sum(spec.nbytes for spec in message.tensors) > limit):
        raise ProtocolError(f"{what}'s buffers are uint8 bytes of shape (n,), {limit} bytes in all")


@dataclass(frozen=True)
class ManifestRequest(Message):
    """Anyone -> node: the manifest of the model file you serve ``model`` from."""

    KIND: ClassVar[Kind] = Kind.MANIFEST_REQUEST
    model: str

    def validate(self) -> None:
        check_text(self.model, "model", MAX_MODEL_CHARS)


@dataclass(frozen=True)
class Manifest(Message):
    """Node -> asker: buffer 0 is the manifest's canonical JSON (``fabric.compute.gguf_manifest``),
    whose sha256 is ``digest``; the node's file holds layers ``start_layer..end_layer`` of it
    (with the embedding and the output tensors those layers need)."""

    KIND: ClassVar[Kind] = Kind.MANIFEST
    model: str
    digest: str
    start_layer: int
    end_layer: int
    node: str = ""

    def validate(self) -> None:
        check_text(self.model, "model", MAX_MODEL_CHARS)
        _check_digest(self.digest, "digest")
        if not 0 <= self.start_layer <= self.end_layer < MAX_LAYERS:
            raise ProtocolError(f"layers {self.start_layer}-{self.end_layer} out of range")
        if len(self.node) > MAX_ID:
            raise ProtocolError(f"node has at most {MAX_ID} characters")
        _check_bytes_buffer(self, MAX_MANIFEST_BYTES, "MANIFEST")


@dataclass(frozen=True)
class ChunkRequest(Message):
    """Anyone -> node: ``length`` bytes of tensor ``name`` (``@kv``: the metadata section) of the
    file whose manifest digest is ``digest``, from ``offset`` bytes into it, then each tensor
    ``more`` names whole, in order (small tensors: one request and one answer for several, at
    most MAX_CHUNK_PARTS parts of MAX_CHUNK_BYTES in all). ``ref`` comes back."""

    KIND: ClassVar[Kind] = Kind.CHUNK_REQUEST
    SPARSE: ClassVar[frozenset[str]] = frozenset({"more"})
    digest: str
    name: str
    offset: int
    length: int
    ref: int = 0
    more: tuple[str, ...] = ()

    def validate(self) -> None:
        _check_digest(self.digest, "digest")
        for name in (self.name, *self.more):
            check_text(name, "name", MAX_TENSOR_NAME, code=ErrorCode.BAD_REQUEST)
        if not 0 <= self.offset < 1 << 48 or not 1 <= self.length <= MAX_CHUNK_BYTES:
            raise ProtocolError(f"offset must be in [0, 2^48) and length in [1, {MAX_CHUNK_BYTES}]",
                                ErrorCode.BAD_REQUEST)
        if len(self.more) >= MAX_CHUNK_PARTS:
            raise ProtocolError(f"a chunk request asks for at most {MAX_CHUNK_PARTS} parts", ErrorCode.BAD_REQUEST)
        if not 0 <= self.ref < 1 << 63:
            raise ProtocolError("ref must be in [0, 2^63)", ErrorCode.BAD_REQUEST)


@dataclass(frozen=True)
class Chunk(Message):
    """Node -> asker: the bytes CHUNK_REQUEST ``ref`` asked for, a buffer per part in the order
    asked (``name`` and ``offset``: its first part's)."""

    KIND: ClassVar[Kind] = Kind.CHUNK
    ref: int
    name: str
    offset: int

    def validate(self) -> None:
        check_text(self.name, "name", MAX_TENSOR_NAME)
        if not 0 <= self.offset < 1 << 48 or not 0 <= self.ref < 1 << 63:
            raise ProtocolError("offset must be in [0, 2^48) and ref in [0, 2^63)")
        _check_bytes_buffer(self, MAX_CHUNK_BYTES, "CHUNK", MAX_CHUNK_PARTS)


MAX_BAD_PEERS = 16  # peers one FETCH_REPORT may name (a fetch asks at most 16)


@dataclass(frozen=True)
class FetchReport(Message):
    """Fetcher -> tracker: how a fetch of layers from peers goes, and the peers it caught sending
    bytes that fail the manifest (the tracker shows both in STATUS and publishes events)."""

    KIND: ClassVar[Kind] = Kind.FETCH_REPORT
    fetch: str  # the fetcher's id for this fetch (random): its reports update one row
    model: str
    start_layer: int
    end_layer: int
    done: int  # bytes verified so far
    total: int  # bytes the partial copy holds when done
    rate: int = 0  # bytes/s over the last few seconds
    bad_peers: tuple[str, ...] = ()  # node ids caught sending bad bytes (or a manifest that fails), in order
    node: str = ""  # the node id that will serve the layers ("": `meshnet pull`)
    final: bool = False  # the fetch ended: finished, or ``error`` says why not
    error: str = ""

    def validate(self) -> None:
        check_text(self.fetch, "fetch", MAX_REF, code=ErrorCode.BAD_REQUEST)
        check_text(self.model, "model", MAX_MODEL_CHARS, code=ErrorCode.BAD_REQUEST)
        if not 0 <= self.start_layer <= self.end_layer < MAX_LAYERS:
            raise ProtocolError(f"layers {self.start_layer}-{self.end_layer} out of range", ErrorCode.BAD_REQUEST)
        if not 0 <= self.done <= self.total < 1 << 48 or not 0 <= self.rate < 1 << 48:
            raise ProtocolError("done, total and rate must be in [0, 2^48), done <= total", ErrorCode.BAD_REQUEST)
        if len(self.bad_peers) > MAX_BAD_PEERS:
            raise ProtocolError(f"bad_peers names at most {MAX_BAD_PEERS} nodes", ErrorCode.BAD_REQUEST)
        for peer in self.bad_peers:
            check_text(peer, "a bad_peers node id", code=ErrorCode.BAD_REQUEST)
        if len(self.node) > MAX_ID or len(self.error) > 1024:
            raise ProtocolError(f"node has at most {MAX_ID} characters and error at most 1024", ErrorCode.BAD_REQUEST)

MESSAGE_TYPES: dict[Kind, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Forward, Token, CacheMiss, Progress, Cancel, Close, Error, Ping, Pong, Generate, Event,
        Register, Heartbeat, RouteRequest, Route, Report, StatusRequest, Status,
        AssignRequest, Assign, Ack, RelayOpen, RelayOpened, Leave,
        AuditTap, Audit, AuditResult, ReplicasRequest, Replicas, Verdict,
        ManifestRequest, Manifest, ChunkRequest, Chunk, FetchReport,
    )
}

# --------------------------------------------------------------------------- encode


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_LEAVES = (str, int, float, bytes, type(None))  # bool and the int enums are ints


def _plain(value: Any) -> Any:
    if isinstance(value, _LEAVES):  # most of a header: the first test, so it costs one
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {name: _plain(getattr(value, name)) for name in _field_names(type(value))}
    return value


def encode(message: Message, buffers: Sequence[Any] = ()) -> list[Any]:
    """Frames for ``message`` (without envelope). ``buffers`` are raw buffer objects."""
    if len(buffers) != len(message.tensors):
        raise ValueError("one buffer per tensor spec")
    header = {name: None if name == "tensors" else _plain(getattr(message, name))  # its place kept: set below
              for name in _field_names(type(message))}
    for name in message.SPARSE:
        if getattr(message, name) == _defaults(type(message))[name]:
            del header[name]
    header["tensors"] = [{"dtype": t.dtype, "shape": list(t.shape)} for t in message.tensors]
    return [MAGIC, bytes([message.KIND]), msgpack.packb(header, use_bin_type=True), *buffers]


def encode_batch(bodies: Sequence[Sequence[Any]]) -> list[Any]:
    """One BATCH of several messages for one peer (each as ``encode`` framed it), at most MAX_BATCH:
    a pass's FORWARDs to the next hop, or its TOKENs to a head, go as one ZeroMQ message."""
    if not 1 <= len(bodies) <= MAX_BATCH:
        raise ValueError(f"a BATCH carries 1-{MAX_BATCH} messages")
    header = msgpack.packb({"counts": [len(body) for body in bodies]})
    return [MAGIC, bytes([BATCH_KIND]), header, *(frame for body in bodies for frame in body)]


# --------------------------------------------------------------------------- decode


def split_envelope(frames: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Split ROUTER/DEALER frames into (envelope, body) at the first MAGIC-like frame."""
    for i, frame in enumerate(frames[:4]):
        if bytes(memoryview(frame)[:4]) == MAGIC_PREFIX:
            return list(frames[:i]), list(frames[i:])
    raise ProtocolError("no meshnet magic frame in the first four frames")


def unbatch(body: Sequence[Any]) -> list[Sequence[Any]]:
    """The messages a BATCH carries, each as the frames it would have come in alone (for ``decode``),
    in order; any other message: ``[body]``. ProtocolError for a malformed BATCH."""
    if len(body) < 3 or memoryview(body[1]).tobytes() != _BATCH_FRAME:
        return [body]
    views = [memoryview(f) if not isinstance(f, memoryview) else f for f in body]
    header = _header(views)
    counts = header.get("counts")
    if (set(header) != {"counts"} or not isinstance(counts, list) or not 1 <= len(counts) <= MAX_BATCH
            or not all(type(n) is int and 3 <= n <= 3 + MAX_BUFFERS for n in counts)):
        raise ProtocolError(f"a BATCH's header gives counts: 1-{MAX_BATCH} frame counts of 3-{3 + MAX_BUFFERS}")
    if sum(counts) != len(body) - 3:
        raise ProtocolError(f"a BATCH's counts add up to {sum(counts)} frames, but {len(body) - 3} follow")
    at, bodies = 3, []
    for n in counts:
        bodies.append(body[at:at + n])
        at += n
    return bodies


def _header(views: list[memoryview]) -> dict:
    """The header map of a body's frames, after its magic and kind frames are checked."""
    magic = views[0].tobytes()
    if magic != MAGIC:
        if magic[:4] == MAGIC_PREFIX:
            raise ProtocolError(
                f"protocol version {magic[4:]!r} is not supported (this peer speaks {VERSION})",
                ErrorCode.VERSION,
            )
        raise ProtocolError("bad magic frame")
    if views[1].nbytes != 1:
        raise ProtocolError("kind frame must be one byte")
    if views[2].nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("header too large")
    try:
        header = msgpack.unpackb(views[2], raw=False, strict_map_key=True, max_str_len=MAX_STRING,
                                 max_bin_len=MAX_STRING, max_array_len=MAX_LIST, max_map_len=MAX_LIST)
    except Exception as exc:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    return header


def decode(body: Sequence[Any], max_buffer_bytes: int = MAX_BUFFER_BYTES) -> tuple[Message, list[memoryview]]:
    """Validate and decode a body (frames from MAGIC on). Returns (message, buffers).

    Buffers come back as memoryviews over the received frames: no copy is made.
    """
    if len(body) < 3:
        raise ProtocolError(f"a message has at least 3 frames, got {len(body)}")
    views = [memoryview(f) if not isinstance(f, memoryview) else f for f in body]
    kind_frame = views[1].tobytes()
    if kind_frame == _BATCH_FRAME:
        raise ProtocolError("a BATCH carries messages to a node; it is not one (nor inside one)")
    header = _header(views)  # (the kind frame is one byte)
    try:
        kind = Kind(kind_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_frame[0]}") from None
    buffers = views[3:]
    specs = _tensor_specs(header.pop("tensors", []), buffers, max_buffer_bytes)
    message = _build(MESSAGE_TYPES[kind], header, specs)
    return message, buffers


def _tensor_specs(raw: Any, buffers: list[memoryview], max_buffer_bytes: int) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_BUFFERS:
        raise ProtocolError("tensors must be a list of at most %d specs" % MAX_BUFFERS)
    if len(raw) != len(buffers):
        raise ProtocolError(f"header names {len(raw)} tensors but {len(buffers)} buffers follow")
    specs = []
    for spec, buf in zip(raw, buffers):
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape"}:
            raise ProtocolError("a tensor spec is a map with exactly dtype and shape")
        dtype, shape = spec["dtype"], spec["shape"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ProtocolError(f"dtype {dtype!r} is not allowed")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_TENSOR_DIMS
                or not all(type(d) is int and 0 <= d <= 1 << 31 for d in shape)):
            raise ProtocolError("shape must be 1-4 non-negative ints")
        t = TensorSpec(dtype, tuple(shape))
        if t.nbytes > max_buffer_bytes:
            raise ProtocolError(f"tensor of {t.nbytes} bytes exceeds the {max_buffer_bytes}-byte limit")
        if t.nbytes != buf.nbytes:
            raise ProtocolError(f"tensor spec says {t.nbytes} bytes but the buffer has {buf.nbytes}")
        specs.append(t)
    return tuple(specs)


@functools.cache
def _defaults(cls: type) -> dict[str, Any]:
    """The default of each field of a message class that has one."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


@functools.cache
def _schema(cls: type) -> tuple[tuple[tuple[str, Any, bool, str], ...], frozenset]:
    """A message class's header fields, resolved once per class: (name, type hint, required,
    where) each, and the set of their names."""
    hints = typing.get_type_hints(cls)
    fields = tuple((f.name, hints[f.name],
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                    f"{cls.__name__}.{f.name}")
                   for f in dataclasses.fields(cls) if f.init and f.name != "tensors")
    return fields, frozenset(name for name, _, _, _ in fields)


def _build(cls: type, header: dict, specs: tuple[TensorSpec, ...] = ()) -> Any:
    """Build dataclass ``cls`` from a header map, checking every field's type."""
    fields, names = _schema(cls)
    if not names.issuperset(header):
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(set(header) - names)[:5]}")
    kwargs = {}
    for name, hint, required, where in fields:
        if name in header:
            kwargs[name] = _coerce(header[name], hint, where)
        elif required:
            raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
    if issubclass(cls, Message):
        kwargs["tensors"] = specs
    obj = cls(**kwargs)
    obj.validate()
    return obj


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if hint is int or hint is str or hint is bool:  # most fields: checked before the generic cases
        if type(value) is not hint:
            raise ProtocolError(f"{where} must be {'an int' if hint is int else f'a {hint.__name__}'}")
        return value
    if hint is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ProtocolError(f"{where} must be a finite number")
        return float(value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list")
        (inner, _) = typing.get_args(hint)
        return tuple(_coerce(v, inner, where) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be a map")
        key_hint, value_hint = typing.get_args(hint)
        return {_coerce(k, key_hint, f"{where} key"): _coerce(v, value_hint, f"{where}[{k!r}]")
                for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be a map")
        return _build(hint, value)
    if hint is dict:
        if type(value) is not hint:
            raise ProtocolError(f"{where} must be a {hint.__name__}")
        return value
    raise TypeError(f"no coercion for {hint!r}")  # a bug in this module, not in the peer
