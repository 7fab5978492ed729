"""One request's distributed life, owned in one place (the head's side of a route).

A RouteSession tokenizes (the head owns the tokenizer and chat template), sends the
prompt along the route, turns each TOKEN the tail returns into a client event, applies
EOS, stop strings and max_tokens, feeds the token back for the next step, re-prefills
the whole history after a CACHE_MISS, and on every ending (done, cancel, error) tells
every hop to free the session's KV. It never touches a socket: it talks through a
``Transport`` (the node daemon's sockets, or an in-process one in tests).
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from jinja2.exceptions import TemplateError

from ..wire.protocol import (
    CacheMiss,
    Cancel,
    Close,
    Error,
    ErrorCode,
    Event,
    EventKind,
    FinishReason,
    Forward,
    Generate,
    Hop,
    Logprob,
    Progress,
    Sampling,
    Token,
    TokenLogprobs,
)
from .prefixes import Reuse
from .route_failover import Failover
from .speculation import Speculation
from .tool_use import chat_input

log = logging.getLogger(__name__)


class Transport(Protocol):
    def forward(self, hop: Hop, message: Forward, tensor: torch.Tensor) -> None: ...
    def control(self, hop: Hop, message: Cancel | Close) -> None: ...


class RequestError(Exception):
    """A request the head refuses before any work (bad input, prompt too long)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Detokenizer:
    """Incremental detokenization with stop strings held back until they cannot match."""

    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # all complete text decoded so far
    emitted: int = 0  # chars of ``text`` already sent to the client
    _prefix: int = 0
    _read: int = 0

    def add(self, token: int) -> tuple[str, bool]:
        """Feed a token; returns (text to emit now, whether a stop string matched)."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[:at]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self._held_back()), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that could still start a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if s.startswith(self.text[-n:]):
                    best = n
                    break
        return best

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out


MAX_CHARS_PER_TOKEN = 16  # a prompt longer than this many characters per allowed token is refused untokenized


def encode_prompt(tokenizer, request: Generate, max_prompt_tokens: int) -> list[int]:
    """Token ids of the request's prompt; the chat template applies to ``messages``. A prompt
    far too long to fit is refused before tokenizing: tokenizing a megabyte would stall the
    node's loop for every session it serves."""
    chars = len(request.prompt or "") + sum(len(str(m.get("content") or "")) for m in request.messages or ())
    if chars > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
        raise RequestError(ErrorCode.PROMPT_TOO_LONG, f"prompt has {chars} characters; this route takes at most "
                                                      f"{max_prompt_tokens} tokens")
    if request.messages is not None:
        tools = [dict(t) for t in request.tools.functions] if request.tools is not None else None
        ids = _chat_ids(tokenizer, *chat_input(tokenizer, list(request.messages), tools))
    else:
        ids = tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
    ids = list(ids)
    if not ids:
        raise RequestError(ErrorCode.BAD_REQUEST, "the prompt is empty")
    if len(ids) > max_prompt_tokens:
        raise RequestError(ErrorCode.PROMPT_TOO_LONG,
                           f"prompt has {len(ids)} tokens; this route takes at most {max_prompt_tokens}")
    return ids


def _chat_ids(tokenizer, messages: list, tools: list[dict] | None = None) -> list[int]:
    """The chat template's token ids. A template that refuses the messages with its own words
    (``raise_exception``: roles out of turn, or a model whose chats no template formats, see
    fabric.compute.templates) refuses the request; a broken template is the node's error."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError(ErrorCode.BAD_REQUEST, "this model has no chat template; send raw prompts to "
                                                  "/v1/completions (prompt= in the Python client)")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    except TemplateError as exc:
        if type(exc) is not TemplateError:  # a syntax error, an undefined name: the template's fault
            raise
        raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None


@dataclass
class PrefillProgress:
    """How far one step's prefill has come along the route. Each hop says, after each prefill
    chunk it ran, how many positions it holds (PROGRESS); a hop holds at least what any later
    hop holds; and the route's count weighs each hop by its share of the layers."""

    start: int = 0  # positions held before the step (a continued history, a reused prefix)
    total: int = 0  # positions the step's prefill reaches; 0: no prefill runs (a decode step)
    hops: dict[int, int] = field(default_factory=dict)  # a hop's last layer -> positions it holds

    def begin(self, pos: int, tokens: int) -> None:
        """A step of ``tokens`` from ``pos`` is sent: a prefill when it has more than one."""
        self.start, self.total, self.hops = pos, pos + tokens if tokens > 1 else 0, {}

    def tokens(self, route: tuple[Hop, ...]) -> int:
        """Positions the route has prefilled: each hop's count weighed by its layers."""
        if not self.total:
            return 0
        done, held = 0, self.start
        for hop in reversed(route):
            held = max(held, self.hops.get(hop.end_layer, 0))
            done += held * (hop.end_layer - hop.start_layer + 1)
        return min(self.total, done // (route[-1].end_layer + 1))


@dataclass
class Ahead:
    """A verification step sent before the pending one was answered (pipelined speculation): it
    assumes every draft of the pending step kept, and guesses the token the tail answers after
    them (``ids[0]``); the rest of ``ids`` are its drafts."""

    step: int
    pos: int
    ids: list[int]
    failed: CacheMiss | Error | None = None  # a hop's answer that it failed, kept until it is the pending step


def eos_ids(tokenizer, config) -> frozenset[int]:
    ids = {tokenizer.eos_token_id, *_as_list(getattr(config, "eos_token_id", None))}
    return frozenset(i for i in ids if i is not None)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def new_session_id() -> str:
    """A session's id on the hops: 128 random bits. It is never published (the client and
    the tracker know the request by other names), so a stranger cannot name the session, and
    knowing it is not enough to steer it (fabric/node/owners.py)."""
    return secrets.token_hex(16)


class RouteSession(Failover):
    """The head's state machine for one request. Feed it messages; it returns events."""

    def __init__(self, request: Generate, prompt_ids: list[int], *, tokenizer, eos: frozenset[int],
                 reply_to: str, transport: Transport, seed: int, reply_key: str = "", wire_dtype: str = "",
                 session: str = "", tool_syntax: str = "", speculation: Speculation | None = None):
        self.request = request
        self.session = session or new_session_id()  # the hops' name for it: a secret of the head and the route
        self.request_id = request.request_id  # the client's name for it, in its events
        self.tool_syntax = tool_syntax  # how the reply writes tool calls, for the client to parse ("": none)
        self.ref = secrets.token_hex(8)  # this head's name for it, in its reports: what the ledger bills by
        self.route = request.route
        self.history = list(prompt_ids)  # prompt + every generated token fed so far
        self.prompt_tokens = len(prompt_ids)
        self.resumed = len(request.resume)  # of the generated tokens, those a head that died had streamed
        self.generated: list[int] = []
        self.eos = eos
        self.reply_to = reply_to
        self.reply_key = reply_key  # this head's CURVE public key, for hops that answer it
        self.transport = transport
        self.wire_dtype = wire_dtype  # hidden states on this route's wire ("": each node's compute dtype)
        self.sampling = Sampling(request.sampling.temperature, request.sampling.top_k,
                                 request.sampling.top_p, request.sampling.seed if request.sampling.seed
                                 is not None else seed)
        self.detok = Detokenizer(tokenizer, request.stop)
        self.step = -1  # the pending step's number: replies of any other are stale
        self.sent = -1  # the number of the last step sent (the pending one, or one sent ahead of it)
        self.finished: str | None = None
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.cache_misses = 0
        self.sent_at = time.monotonic()  # when the pending step was sent
        self.retries = 0  # re-sends after a hop went silent
        self.excluded: set[str] = set()  # node ids that died under this request
        self.awaiting_route = False  # a failover asked the tracker for a new route
        self.failovers = 0
        self.lost: set[str] = set()  # the hops the pending failover routes around
        self.replan_after = 0.0  # no new failover before this (monotonic clock)
        self.replan_backoff = 1.0  # seconds, doubled after each failover that found no route
        self.reported_at = float("-inf")  # when the head last reported progress to the tracker
        self.prefill = PrefillProgress()  # how far the pending step's prefill has come
        self.told_at = float("-inf")  # when the client last got a TOKEN or PROGRESS event
        self.reused: Reuse | None = None  # the ended session whose kept KV this request started from
        self.held = 0  # positions of ``history`` every hop of the route is known to hold (a TOKEN says so)
        self.speculation = speculation  # drafts for the decode steps; None: one token a step
        self.drafts: list[int] = []  # the pending step's drafts (a TOKEN per draft kept, and one more, answer it)
        self.kept = 0  # of those, the ones kept so far
        self.expect = 0  # the position of the pending step's next TOKEN
        self.decoding = False  # the pending step is a decode step, sent once (its trip times the route)
        self.ahead: Ahead | None = None  # the step sent ahead of the pending one's answer, if any
        self.pipelined = False  # the pending step was sent ahead: its answer times no trip

    # -- inputs -------------------------------------------------------------------------

    def start(self, reuse: Reuse | None = None) -> list[Event]:
        """Send the prompt (after the resumed tokens, when a head that died streamed some);
        with ``reuse``, only what follows the ended session's kept KV."""
        self.reused = reuse
        start = [Event(self.request_id, EventKind.START, route=self.route, prompt_tokens=self.prompt_tokens,
                       seed=self.sampling.seed, tool_syntax=self.tool_syntax)]
        if ended := self._resume(self.request.resume):
            return start + ended
        if reuse is None:
            self._send(self.history, pos=0)
        else:
            self._send(self.history[reuse.tokens:], pos=reuse.tokens, reuse=reuse.session)
        return start

    def on_token(self, msg: Token) -> list[Event]:
        if self.finished or msg.step != self.step or (self.drafts and msg.pos != self.expect):
            return []  # stale reply from before a re-prefill or after the end
        self.told_at = time.monotonic()
        self.held = msg.pos  # the tail answered: every hop ran every position before this token's
        self.first_token_at = self.first_token_at or time.monotonic()
        events = self._take(msg.token, self._logprobs(msg))
        self.expect += 1
        if self.finished or (self.kept < len(self.drafts) and msg.token == self.drafts[self.kept]):
            self.kept += 1
            return events  # the end, or a draft kept: the TOKEN after it follows
        if self.speculation is not None and self.decoding:
            trip = None if self.pipelined else time.monotonic() - self.sent_at
            self.speculation.answered(len(self.drafts), self.kept, trip)
        ahead, self.ahead = self.ahead, None
        if ahead is None or self.kept < len(self.drafts) or msg.token != ahead.ids[0]:
            self._step()  # the step sent ahead, if any, is void: the tail answers nothing, and this one cuts it off
            return events
        return events + self._promote(ahead)

    def _step(self) -> None:
        """Send the next decode step: the last token, and the drafts after it if any; and, where
        it pays, the step after it too, ahead of its answer."""
        drafts, q = [], ()
        if self.speculation is not None:
            drafts = self.speculation.drafts(self.history, self.request.max_tokens - len(self.generated) - 1)
            q = tuple(self.speculation.q)  # a draft model's distributions (a sampling request), else none
        self._send(self.history[-1:] + drafts, pos=len(self.history) - 1, drafts=drafts, draft_q=q)
        self.decoding = True
        self._send_ahead()

    def _send_ahead(self) -> None:
        """Send the step after the pending one before its answer comes (``Speculation.ahead``):
        the guess of the token after its drafts, at the position after them, and drafts after it.
        By default only on a route with a hop on another machine: on one machine the hops take
        turns on its cores (the compute lock), a trip is compute through and through, and a step
        sent ahead only delays the one before it (0.87-0.91x on loopback, docs/BENCHMARKS.md)."""
        if self.speculation is None or not self.drafts:
            return
        if self.speculation.config.ahead == "auto" and all(h.host == self.route[0].host for h in self.route):
            return  # a route that never leaves this machine has no wait to hide a step's compute in
        room = self.request.max_tokens - len(self.generated) - len(self.drafts) - 1
        ids = self.speculation.ahead(self.history, self.drafts, room, greedy=not self.sampling.temperature)
        if not ids:
            return
        self.sent += 1
        self.ahead = Ahead(self.sent, len(self.history) + len(self.drafts), ids)
        self._forward(ids, self.ahead.pos, self.sent, drafts=ids[1:], draft_q=tuple(self.speculation.q), guess=ids[0])

    def _promote(self, ahead: Ahead) -> list[Event]:
        """The step sent ahead holds (every draft before it kept, and its guess the tail's token):
        it is the pending step now, and the one after it is sent ahead in turn. A hop's failure
        it met is answered now."""
        self.step, self.sent_at, self.pipelined = ahead.step, time.monotonic(), True
        self.drafts, self.kept, self.expect = ahead.ids[1:], 0, ahead.pos + 1
        self.speculation.aheads_held += 1
        if isinstance(ahead.failed, CacheMiss):
            return self.on_cache_miss(ahead.failed)
        if ahead.failed is not None:
            return self.on_error(ahead.failed)
        self._send_ahead()
        return []

    def _ahead_failed(self, msg: CacheMiss | Error) -> bool:
        """``msg`` says the step sent ahead failed at a hop: kept for when it is the pending step."""
        if self.ahead is None or msg.step != self.ahead.step:
            return False
        self.ahead.failed = self.ahead.failed or msg
        return True

    def _logprobs(self, msg: Token) -> TokenLogprobs | None:
        """The logprobs of ``msg``'s token as the client reads them, if the request asked (and
        the tail sent them): each token with its text, decoded alone."""
        if self.request.logprobs < 0 or msg.logprob is None:
            return None
        decode = self.detok.tokenizer.decode
        top = tuple(Logprob(t, decode([t]), lp) for t, lp in zip(msg.top_ids, msg.top_logprobs))
        return TokenLogprobs(msg.token, decode([msg.token]), msg.logprob, top[:self.request.logprobs])

    def _take(self, token: int, logprobs: TokenLogprobs | None = None) -> list[Event]:
        """Count ``token`` as generated: its text (stop strings held back), and the end when it
        is one (EOS, a stop string, max_tokens); else it joins the history, to be fed next."""
        self.generated.append(token)
        if token in self.eos and not self.request.ignore_eos:
            return [self._token_event(token, self.detok.flush(), logprobs), *self._finish(FinishReason.STOP)]
        text, stopped = self.detok.add(token)
        events = [self._token_event(token, text, logprobs)]
        if stopped:
            return events + self._finish(FinishReason.STOP)
        if len(self.generated) >= self.request.max_tokens:
            return events + self._finish(FinishReason.LENGTH, tail=self.detok.flush())
        self.history.append(token)
        return events

    def _resume(self, ids: tuple[int, ...]) -> list[Event]:
        """Take ``ids``, streamed by a head that died, as if this session had generated them: the
        history, the count, the text and stop strings' state. Their events are not sent again
        (the client has them); what ends the request is, when they already end it (the client
        lost the end with the head). Ids after the end fail the request (bad_request)."""
        events: list[Event] = []
        for n, token in enumerate(ids, 1):
            events = self._take(token)
            if self.finished and n < len(ids):
                self.finished = None  # not an end: a request that cannot be
                return self.fail(ErrorCode.BAD_REQUEST, f"resume goes on after the end of the reply (token {n})")
        return events[1:] if self.finished else []

    def on_cache_miss(self, msg: CacheMiss) -> list[Event]:
        if self.finished or self._ahead_failed(msg) or msg.step != self.step:
            return []
        self.cache_misses += 1
        if self.speculation is not None and self.drafts:
            self.speculation.stop()  # a hop that cannot cut drafted positions off would miss at every step
        log.info("session %s: %s lost its KV (has %d tokens); re-prefilling %d tokens",
                 self.session, msg.node, msg.have, len(self.history))
        if self.cache_misses > 8:
            return self.fail(ErrorCode.HOP_FAILED, "a hop keeps losing this session's KV")
        self._send(self.history, pos=0)
        return []

    def on_error(self, msg: Error) -> list[Event]:
        if self.finished or self._ahead_failed(msg) or (msg.step is not None and msg.step != self.step):
            return []
        return self.fail(msg.code, f"{msg.node or 'a hop'}: {msg.message}")

    def check_timeout(self, now: float, timeout: float, max_retries: int = 3) -> list[Event]:
        """No reply for ``timeout`` seconds: the frame was lost (a hop died or restarted).

        Re-prefill the whole history along the route; a restarted hop picks it up. Each
        retry waits twice as long as the one before (backoff), then the request fails.
        """
        if self.finished or self.awaiting_route or now - self.sent_at < timeout * 2 ** self.retries:
            return []
        self.retries += 1
        if self.retries > max_retries:
            return self.fail(ErrorCode.HOP_FAILED, f"no reply from the route after {max_retries} re-sends")
        log.warning("session %s: no reply to step %d (%d tokens so far) for %.1f s; re-prefilling (try %d)",
                    self.session, self.step, len(self.history), now - self.sent_at, self.retries)
        self._send(self.history, pos=0)
        return []

    def on_progress(self, msg: Progress, now: float, every: float) -> list[Event]:
        """A hop ran a chunk of the pending step's prefill, or holds the step in its queue: the
        step is not lost, so its reply timeout counts from now (a long prompt, or a wait behind
        other sessions' work, may take longer than one). The client hears it as a PROGRESS event
        when the prefill count grew, else when it heard nothing for ``every`` seconds."""
        if self.finished or msg.step != self.step:
            return []
        self.sent_at = now
        before = self.prefilled
        if self.prefill.total:
            self.prefill.hops[msg.end_layer] = max(msg.done, self.prefill.hops.get(msg.end_layer, 0))
        if self.prefilled <= before and now - self.told_at < every:
            return []
        self.told_at = now
        return [Event(self.request_id, EventKind.PROGRESS, prompt_tokens=self.prompt_tokens,
                      completion_tokens=len(self.generated), prefilled=self.prefilled,
                      prefill_tokens=self.prefill.total)]

    @property
    def prefilled(self) -> int:
        return self.prefill.tokens(self.route)

    def cancel(self) -> list[Event]:
        """The client went away or pressed stop: free every hop's KV."""
        if self.finished:
            return []
        self.finished = "cancelled"
        self._tell_route(Cancel)
        return [self._done(FinishReason.CANCELLED)]

    def fail(self, code: str, message: str) -> list[Event]:
        if self.finished:
            return []
        self.finished = "error"
        self._tell_route(Cancel)
        return [Event(self.request_id, EventKind.ERROR, text=message, error_code=code, finish_reason=FinishReason.ERROR,
                      prompt_tokens=self.prompt_tokens, completion_tokens=len(self.generated))]

    # -- internals ----------------------------------------------------------------------

    def _send(self, ids: list[int], pos: int, reuse: str = "", drafts: list[int] = (), draft_q: tuple = ()) -> None:
        """Send ``ids`` from ``pos`` along the route as one step (each hop may run a long
        prefill in slices, passed on as chunks of the same step); the last ``drafts`` of them
        drafted, for the tail to verify (``draft_q``: the distributions a draft model drew them from).
        It is the pending step: one sent ahead before it is void."""
        self.sent += 1
        self.step, self.ahead, self.pipelined = self.sent, None, False
        self.sent_at = time.monotonic()
        self.decoding = False  # a prompt, a re-prefill or a re-send: no decode step's trip
        self.prefill.begin(pos, len(ids) - len(drafts))
        self.drafts, self.kept, self.expect = list(drafts), 0, pos + len(ids) - len(drafts)
        if pos == 0 or reuse:
            self.held = 0  # the hops start the session over: nothing is known held until a TOKEN
        self._forward(ids, pos, self.step, reuse, drafts, draft_q)

    def _forward(self, ids: list[int], pos: int, step: int, reuse: str = "", drafts: list[int] = (),
                 draft_q: tuple = (), guess: int = -1) -> None:
        """The FORWARD of step number ``step`` to the route's first hop."""
        head = self.route[0]
        opens = pos == 0 or bool(reuse)  # the tail hears what the session asks once, on the steps that open it
        penalties = grammar = None
        if opens and self.request.penalties is not None:  # counted from the tokens generated so far (a re-prefill's)
            penalties = dataclasses.replace(self.request.penalties, generated=tuple(self.generated))
        if opens and self.request.grammar is not None:  # the tail's matcher is rebuilt past the tokens generated
            grammar = dataclasses.replace(self.request.grammar, generated=tuple(self.generated))
        msg = Forward(session=self.session, step=step, pos=pos, start_layer=head.start_layer,
                      end_layer=head.end_layer, route=self.route[1:], reply_to=self.reply_to,
                      sampling=self.sampling, reply_key=self.reply_key, wire_dtype=self.wire_dtype, reuse=reuse,
                      logprobs=self.request.logprobs if opens else -1, penalties=penalties, grammar=grammar,
                      drafts=tuple(drafts), draft_q=draft_q, guess=guess)
        self.transport.forward(head, msg, torch.tensor([ids], dtype=torch.int64))  # (1, q)

    def _finish(self, reason: str, tail: str = "") -> list[Event]:
        self.finished = reason
        self._tell_route(Close)
        events = [self._token_event(None, tail)] if tail else []
        return events + [self._done(reason)]

    def _tell_route(self, kind: type[Cancel] | type[Close]) -> None:
        # the first hop passes it along the rest of the route
        self.transport.control(self.route[0], kind(session=self.session, route=self.route[1:]))

    def _token_event(self, token: int | None, text: str, logprobs: TokenLogprobs | None = None) -> Event:
        return Event(self.request_id, EventKind.TOKEN, text=text, token_ids=() if token is None else (token,),
                     completion_tokens=len(self.generated), logprobs=() if logprobs is None else (logprobs,))

    def _done(self, reason: str) -> Event:
        return Event(self.request_id, EventKind.DONE, finish_reason=reason, prompt_tokens=self.prompt_tokens,
                     completion_tokens=len(self.generated), route=self.route)

    @property
    def held_ids(self) -> list[int]:
        """The token ids whose KV every hop of the route holds, in order."""
        return self.history[:self.held]

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started_at
