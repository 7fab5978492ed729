"""The hop scheduler: which queued hops run next, as one forward pass, and when.

No sockets and no torch: it takes hops (a FORWARD and its input, of which it reads only
the token count), the sessions holding KV here, and a clock, and hands back batches to
run. The node runs them and tells it how long they took.

Two aims pull against each other. Streams that decode here want their steps batched and
never stalled; a long prompt wants to move on. So a long prefill is cut into slices, and
a slice rides along in a decode batch's forward pass (the layers' weights are read once
for both, so the slice costs only its own tokens), sized to add about RIDE_PER_DECODE of
a decode batch's time to that pass. A slice that cannot ride (other layers, or a model
whose layers cannot batch) takes turns with the decode batches instead. A decode batch
waits a little for the sessions due here, which pulls them into step so that they then
arrive together. An audit's replay for another head (``Replay``) takes its turn like a
prompt that cannot ride: when nothing else waits, or after a decode batch.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection

from ..wire import protocol as p

FIRST_SLICE_TOKENS = 32  # prefill tokens per slice before this node has timed any
MIN_SLICE_TOKENS = 8  # a slice's fixed cost (reading the weights) dwarfs this many tokens' own
MAX_SLICE_TOKENS = 4096
LIGHT_TOKENS = 4  # a prompt's last piece this short runs as a decode step does (``Work.light``)
WHOLE_PREFILL_TOKENS = 64  # a prefill this short runs whole: sliced, each piece would cost nearly as much
PREFILL_BATCH_TOKENS = 256  # short prompts queued together run as one forward pass of at most this many tokens
SLICE_PER_DECODE = 1.0  # a prefill slice beside decoding streams may take this many of their decode batches
RIDE_PER_DECODE = 2.0  # ...and riding in their pass, add this many (a stream then waits ~3 decode batches at most)
MIN_SLICE_S = 0.02  # ...and at least this long (alone: a slice reads all the weights, as a decode batch does)
IDLE_SLICE_S = 0.25  # ...and with no stream decoding here, this long
GATHER_PER_DECODE = 1.0  # a decode batch waits at most this many passes' time for sessions still due
RECENT_CYCLES = 3.0  # a session is due here while its last decode step is this many of its cycles old
# Nodes that decode at once (no gathering) run this many sessions decoding through them, and more, as
# two groups of half each: one group's pass at this node while the other's is at the next
# (docs/BENCHMARKS.md, "Two groups, a pipeline"). Fewer run as one group.
SPLIT_FROM = 8
MAX_CYCLE_JUMP = 2.0  # one gap between a session's decode steps counts as this many cycles at most
WAITING_REPORT_S = 0.5  # how often a node tells heads that their sessions' hops wait in its queue


@dataclass
class Work:
    """A hop to execute: a FORWARD and its input (already validated): token ids
    (1, tokens) at the first layer, else hidden states (1, tokens, hidden)."""

    msg: p.Forward
    tensor: Any  # a torch.Tensor; only its shape is read here

    @property
    def session(self) -> str:
        return self.msg.session

    @property
    def tokens(self) -> int:
        return self.tensor.shape[1]

    @property
    def span(self) -> tuple[int, int]:
        return self.msg.start_layer, self.msg.end_layer

    @property
    def decode(self) -> bool:
        """One token after a prompt: a decode step, batched with other sessions' steps in the
        batch group (not the first step of a session that starts from kept KV: a chunk)."""
        return self.tokens == 1 and self.msg.pos > 0 and not self.msg.more and not self.msg.reuse

    @property
    def light(self) -> bool:
        """A hop a decode pass's threads run as fast as every thread would: a decode step, or a
        prompt's last piece of at most LIGHT_TOKENS tokens (what follows kept KV of a prompt
        asked again: a decode step's work)."""
        return self.decode or (self.tokens <= LIGHT_TOKENS and not self.msg.more and not self.msg.drafts)

    @property
    def verifies(self) -> bool:
        """A verification step: a decode step and its drafts. It rides in the decode batch's
        pass (in the session's row, fabric/compute/rows.py), and its session decodes here on
        the batch's rhythm like the others."""
        return bool(self.msg.drafts)

    @property
    def starts_decoding(self) -> bool:
        """A prompt's last piece (whole, or what follows kept KV): its session's next hop here is
        a decode step."""
        return not self.decode and not self.msg.more and not self.msg.drafts

    @property
    def reports_progress(self) -> bool:
        """A piece of a prefill in chunks (one that more follow, or the last, at pos > 0): each hop
        tells the head it ran it. Not a verification step: its TOKENs answer it at once."""
        return self.msg.more or (self.msg.pos > 0 and not self.decode and not self.msg.drafts)

    @property
    def short_prompt(self) -> bool:
        """A whole prompt short enough to run unsliced (and so with other such prompts)."""
        return self.msg.pos == 0 and not self.msg.more and self.tokens < WHOLE_PREFILL_TOKENS

    @property
    def short_chunk(self) -> bool:
        """The last or only piece of a prompt (a whole short prompt, what follows kept KV, a
        long prompt's last slice), short enough to run unsliced: one forward pass takes
        several such pieces, and they ride in decode batches together."""
        return not self.decode and not self.msg.more and self.tokens < WHOLE_PREFILL_TOKENS

    def cut(self, n: int) -> tuple["Work", "Work"]:
        """The first ``n`` tokens as a chunk that more follow, and the rest (which continues
        the session: only the first chunk starts it from kept KV)."""
        msg = self.msg
        return (Work(dataclasses.replace(msg, more=True), self.tensor[:, :n]),
                Work(dataclasses.replace(msg, pos=msg.pos + n, reuse=""), self.tensor[:, n:]))


@dataclass
class Replay:
    """An AUDIT to run for a head (fabric/node/taps.py): its message and input, validated. A long
    one runs in slices, each a turn between decode batches as a prompt's slice is."""

    msg: Any  # a p.Audit
    tensor: Any  # token ids (1, q) or hidden states (1, q, hidden)
    done: int = 0  # positions run so far
    outputs: list = dataclasses.field(default_factory=list)  # each slice's output

    @property
    def session(self) -> str:
        """The session its KV lives in while it runs (dropped at its end)."""
        return f"audit:{self.msg.audit}"

    @property
    def tokens(self) -> int:
        return self.tensor.shape[1]


MAX_REPLAYS = 8  # audits queued here at once; more are refused (the head asks another replica)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 16  # decode steps of different sessions run as one forward pass
    prefill_slice: float = 0.0  # seconds of prefill run between decode batches while streams decode; 0: auto


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else old + weight * (new - old)


class HopScheduler:
    """Queued hops in, batches out. ``live`` is the set of sessions holding KV here (read
    live: a session freed there is no longer waited for); ``batchable(start, end)`` says
    whether hops over those layers can share a forward pass; ``shared_lock`` whether other
    nodes on this machine take turns with this one at the compute."""

    def __init__(self, config: SchedulerConfig, live: Collection[str],
                 batchable: Callable[[int, int], bool] = lambda start, end: True, shared_lock: bool = False,
                 gather: bool = True):
        self.config = config
        self.live = live
        self.batchable = batchable
        self.shared_lock = shared_lock
        self.gather = gather  # decode batches wait for every session due here (False: for their own group)
        self.queue: deque[Work] = deque()
        self.replays: deque[Replay] = deque()  # audits' re-runs for heads, each one pass of its own
        self.ran_prefill = False  # the last pass moved a prefill on (alone or riding): decode steps go next
        self.decode_batch_s: float | None = None  # seconds per decode batch here (moving average)
        self.pass_s: float | None = None  # ...and per pass with decode steps, a slice riding or not
        self.ride_token_s: float | None = None  # seconds a riding slice adds to a pass per token (moving average)
        self.cycle_s: float | None = None  # seconds between a session's decode steps here (moving average)
        self.last_decode: dict[str, float] = {}  # session -> when its last decode step ran here
        self.streams: set[str] = set()  # sessions decoding here (a wait for one that gives up keeps it)
        self.gather_since: float | None = None  # when a decode batch began waiting for sessions still due
        self.merge_after = float("-inf")  # no cycle-long wait before this (one waited in vain lately)
        # prefill tokens per slice, steered so a slice takes its target time: riding a decode
        # batch (the time it adds), alone beside streams, alone with none
        self.slice_tokens = {mode: float(FIRST_SLICE_TOKENS) for mode in ("ride", "busy", "idle")}
        self.waiting_at = float("-inf")  # when ``waiting`` last named the queued sessions

    def __len__(self) -> int:
        return len(self.queue) + len(self.replays)

    def push(self, work: Work) -> None:
        self.queue.append(work)

    def push_replay(self, replay: Replay) -> bool:
        """Queue an audit's replay; False when MAX_REPLAYS wait already."""
        if len(self.replays) >= MAX_REPLAYS:
            return False
        self.replays.append(replay)
        return True

    def resume_replay(self, replay: Replay) -> None:
        """A replay that ran a slice and has more: it goes on at its next turn, before any other."""
        self.replays.appendleft(replay)

    def replay_slice(self, replay: Replay) -> int:
        """Positions of ``replay`` to run at this turn: a prompt's slice beside the streams here,
        all that is left where that is under two slices."""
        left = replay.tokens - replay.done
        n = int(self.slice_tokens[self.slice_mode(replay.session)])
        return left if left < max(2 * n, WHOLE_PREFILL_TOKENS) else n

    def drop(self, session: str) -> None:
        """Forget ``session``: its queued hops and its decode rhythm."""
        self.queue = deque(w for w in self.queue if w.session != session)
        self.last_decode.pop(session, None)
        self.streams.discard(session)

    def waiting(self, now: float) -> list[Work]:
        """The first queued hop of each session, every WAITING_REPORT_S (else none): a step
        that waits its turn behind other sessions' work is not lost, and its head hears so."""
        if now - self.waiting_at < WAITING_REPORT_S:
            return []
        self.waiting_at = now
        first: dict[str, Work] = {}
        for work in self.queue:
            first.setdefault(work.session, work)
        return list(first.values())

    def forget_freed(self) -> None:
        """Drop the decode times of sessions whose KV is gone."""
        if len(self.last_decode) > len(self.live):
            self.last_decode = {s: t for s, t in self.last_decode.items() if s in self.live}
        if len(self.streams) > len(self.live):
            self.streams = {s for s in self.streams if s in self.live}

    # -- when ---------------------------------------------------------------------------

    def wait(self, now: float) -> float:
        """Seconds the queued work should still wait for sessions due here (0: run now).

        Sessions reach a node out of step (prompts start at different times), and a node
        that runs each as it comes keeps them out of step: it runs batches of one, each
        costing nearly a whole batch's time. So a decode batch waits, at most
        GATHER_PER_DECODE of a batch's time, for the sessions that decoded here within their
        last few cycles. A queued prefill does not wait: it runs in the meantime. Except
        under a shared compute lock, after a prefill slice: another slice now would hold the
        lock while the other nodes of the machine have those sessions' decode steps to run,
        so the node waits (at most one of their cycles) for them to come back first (not a node
        that decodes at once: the others run those steps without the lock). A prefill that can
        ride the decode batch waits with it: it goes in the same pass. Under a shared lock a
        decode batch too waits up to one cycle: the streams' other hops run meanwhile,
        and streams that fell into two groups (a long pass, a prompt arriving) merge again.
        When such a wait runs out without them, each group may be queued at the node the
        other waits on: for RECENT_CYCLES cycles the batch waits only a pass's time, or the
        two nodes would wait on each other at every token.

        Without ``gather`` (nodes that decode at once: HopRunner's decode threads) a decode batch
        waits only for the rest of its group, the sessions that ran in the same pass here last
        time (the node before sends them one after another): the streams then run as groups that
        keep every node busy, a pipeline, where one group would leave all nodes but one idle."""
        decode = self._first(decode=True) or next((w for w in self.queue if w.verifies), None)
        gather = decode is not None and (all(w.decode or w.verifies for w in self.queue) or self._rides(decode))
        yield_to_decode = self.ran_prefill and self.shared_lock and self.gather
        queued = {w.session for w in self.queue}
        due = self._awaited(now, queued) if gather else self._due(now, queued) if yield_to_decode else []
        if not due or len(queued) >= self._decode_cap():
            self.gather_since = None
            return 0.0
        if self.gather_since is None:
            self.gather_since = now
        limit = GATHER_PER_DECODE * (self.pass_s or 0.0) if gather else (self.cycle_s or 0.0)
        merging = gather and self.gather and self.shared_lock and now >= self.merge_after
        if merging:
            limit = max(limit, self.cycle_s or 0.0)
        left = self.gather_since + limit - now
        if left <= 0:
            self.gather_since = None
            for session in due:  # waited a whole limit for them: not due until they decode here again
                self.last_decode.pop(session, None)
            if merging:  # two groups that wait on each other at two nodes: stop trying to merge a while
                self.merge_after = now + RECENT_CYCLES * (self.cycle_s or 0.0)
            return 0.0
        return left

    def _awaited(self, now: float, queued: set[str]) -> list[str]:
        """The sessions a decode batch waits for: those due here; without ``gather``, only those
        that ran here in the same pass as a queued one (their last decode began together)."""
        due = self._due(now, queued)
        if self.gather or not due:
            return due
        passes = {self.last_decode.get(w.session) for w in self.queue if w.decode or w.verifies}
        return [s for s in due if self.last_decode[s] in passes]

    def _due(self, now: float, queued: set[str]) -> list[str]:
        """Sessions that decoded here lately, hold KV, and have nothing queued."""
        horizon = RECENT_CYCLES * (self.cycle_s or 0.0)
        return [s for s, t in self.last_decode.items() if s not in queued and now - t < horizon and s in self.live]

    # -- what ---------------------------------------------------------------------------

    def narrow(self) -> bool:
        """Whether the next batch is light hops alone (``Work.light``: decode steps, prompts' last
        pieces of a few tokens): no other prompt, verification step or replay is queued (each of
        those takes a pass of every thread)."""
        return bool(self.queue) and not self.replays and all(w.light for w in self.queue)

    def next_batch(self) -> list[Work]:
        """The next hops to run as one forward pass: queued decode steps over the same layers,
        with a slice of a queued prompt riding along (one pass for both: the slice costs
        only its own tokens); else a prompt's slice alone, or short whole prompts together
        (one forward pass for many sessions). A prompt that cannot ride takes turns with
        the decode batches, so neither kind stalls the other by more than one pass. A queued
        replay runs alone, when nothing else waits or after a decode batch."""
        if self.replays and (not self.queue or not self.ran_prefill):
            self.ran_prefill = True
            return [self.replays.popleft()]
        first = self.take(decode=self.ran_prefill or self._rides(self._first(decode=True)))
        if first.decode:
            batch = self._batch(first)
            riders = self._riders(batch)
            self.ran_prefill = bool(riders)
            return batch + riders
        self.ran_prefill = True
        first = self.slice(first)
        if not first.short_chunk:
            return [first]
        return self._batch(first)

    def _batch(self, first: Work) -> list[Work]:
        """``first`` and the queued hops of its kind over the same layers, as one batch:
        decode steps, or short chunks of prompts."""
        decode = first.decode  # else a short chunk: both kinds batch with their own kind only
        if not self.batchable(*first.span):
            return [first]
        batch, rest, tokens = [first], deque(), first.tokens
        cap = self._decode_cap(({first.session} | self._coming()) if first.short_chunk else ())
        taken = {first.session}  # a session has at most one hop in a batch
        waiting: set[str] = set()  # sessions with a hop left behind: their later hops wait too
        while self.queue:
            w = self.queue.popleft()
            same = w.span == first.span and w.session not in taken and w.session not in waiting
            alike = w.decode if decode else w.short_chunk
            fits = len(batch) < cap and (decode or tokens + w.tokens <= PREFILL_BATCH_TOKENS)
            if same and alike and fits:
                batch.append(w)
                taken.add(w.session)
                tokens += w.tokens
            else:
                rest.append(w)
                waiting.add(w.session)
        self.queue = rest
        return batch

    def _decode_cap(self, coming: Collection[str] = ()) -> int:
        """Rows one batch takes at most (decode steps, and prompts' short last pieces with them or
        alone): ``max_batch``; without ``gather``, half of the sessions decoding here and
        ``coming`` (whose prompts' last pieces are queued: they decode here next) where they are
        SPLIT_FROM or more, so that they run as two groups (what is left over goes in the next
        pass). A burst of prompts then reaches the next node in two halves, its first half
        computing there while the second computes here."""
        if self.gather:
            return self.config.max_batch
        decoding = len({s for s in self.streams.union(self.last_decode) if s in self.live}.union(coming))
        return min(self.config.max_batch, -(-decoding // 2)) if decoding >= SPLIT_FROM else self.config.max_batch

    def _coming(self) -> set[str]:
        """The sessions of the prompts' short last pieces queued here."""
        return {w.session for w in self.queue if w.short_chunk}

    def _rides(self, decode: Work | None) -> bool:
        """A queued prompt can ride a decode batch that starts with ``decode``."""
        prompt = self._first(decode=False)
        return (decode is not None and prompt is not None and prompt.span == decode.span
                and prompt.session != decode.session and self.batchable(*decode.span))

    def _riders(self, batch: list[Work]) -> list[Work]:
        """Take what rides along with the decode steps of ``batch``: a slice of the first
        queued prompt over the same layers, or, where that is a short chunk, it and the other
        short chunks queued (at most PREFILL_BATCH_TOKENS in all, and within ``_decode_cap``'s
        rows)."""
        prompt = self._first(decode=False)
        if prompt is None or prompt.span != batch[0].span or not self.batchable(*prompt.span) \
                or any(w.session == prompt.session for w in batch):
            return []
        self.queue.remove(prompt)
        if not prompt.short_chunk:
            return [self.slice(prompt, "ride")]
        riders, tokens, taken, earlier = [prompt], prompt.tokens, {w.session for w in batch}, set()
        room = self._decode_cap({prompt.session} | self._coming()) - len(batch)
        for w in list(self.queue):
            if (w.short_chunk and w.span == prompt.span and w.session not in taken | earlier
                    and tokens + w.tokens <= PREFILL_BATCH_TOKENS and len(riders) < room):
                self.queue.remove(w)
                riders.append(w)
                tokens += w.tokens
            earlier.add(w.session)
        return riders

    def _first(self, decode: bool) -> Work | None:
        """The first queued hop of that kind whose session has nothing queued before it (a
        session's hops run in order), or None."""
        return self._first_where(lambda w: w.decode == decode)

    def _first_where(self, wanted: Callable[[Work], bool]) -> Work | None:
        earlier: set[str] = set()
        for w in self.queue:
            if wanted(w) and w.session not in earlier:
                return w
            earlier.add(w.session)
        return None

    def take(self, decode: bool) -> Work:
        """Remove and return the first queued hop of the wanted kind whose session has
        nothing queued before it (a session's hops run in order), else the first hop. The
        streams' turn (``decode``) with no decode step queued goes to a verification step (a
        decode step and its drafts) before a prompt: one queued behind a long prompt's slices
        would otherwise wait for all of them, and its stream with it."""
        w = self._first(decode) or (self._first_where(lambda w: w.verifies) if decode else None)
        if w is None:
            return self.queue.popleft()
        self.queue.remove(w)
        return w

    def slice(self, work: Work, mode: str = "") -> Work:
        """Cut a long prefill into the slice to run now and the rest, queued first. While
        other sessions decode here a slice adds about SLICE_PER_DECODE of their decode
        batch's time to it (riding in their pass, else as a pass of its own), so they wait
        one slice, not the whole prompt; alone, slices of IDLE_SLICE_S keep the node
        answering pings and heartbeats. The rest goes on as further chunks."""
        n = int(self.slice_tokens[mode or self.slice_mode(work.session)])
        if work.tokens < max(2 * n, WHOLE_PREFILL_TOKENS):
            return work  # the rest would be a slice too small to pay its fixed cost
        now, rest = work.cut(n)
        self.queue.appendleft(rest)
        return now

    def slice_mode(self, session: str) -> str:
        """"busy" while other sessions hold KV here or decode steps wait, else "idle"."""
        others = len(self.live) - (session in self.live) > 0 or any(w.decode for w in self.queue)
        return "busy" if others else "idle"

    # -- how long it took ---------------------------------------------------------------

    def ran(self, batch: list[Work], started: float, elapsed: float) -> None:
        """Learn from a batch that began at ``started`` and took ``elapsed`` seconds."""
        streams = [w for w in batch if w.decode or w.verifies]  # sessions decoding here, drafts or not
        begun = [w.session for w in batch if w.starts_decoding]  # prompts done: they decode here next
        if batch[0].decode and not batch[-1].decode:  # prompts rode along: they took what the pass took beyond
            riders = [w for w in batch if not w.decode]
            if len(riders) == 1 and not riders[0].verifies:
                self.steer_ride(riders[0], elapsed - (self.decode_batch_s or 0.0))
            batch = batch[:-len(riders)]
        elif batch[0].decode:
            self.decode_batch_s = _average(self.decode_batch_s, elapsed)
        if streams:
            self.pass_s = _average(self.pass_s, elapsed)
            for work in streams:
                last = self.last_decode.get(work.session)
                if last is not None:  # a stall (a failover, a queue elsewhere) weighs as two cycles at most
                    gap = started - last if self.cycle_s is None else min(started - last, MAX_CYCLE_JUMP * self.cycle_s)
                    self.cycle_s = _average(self.cycle_s, gap)
                self.last_decode[work.session] = started
        for session in begun:  # counted among the streams here (two groups: _decode_cap), in this pass's group
            self.last_decode[session] = started
        self.streams.update(begun, (w.session for w in streams))
        if not batch[0].decode and len(batch) == 1 and not batch[0].verifies:  # a batch of prompts says nothing
            self.steer_slices(batch[0].session, batch[0].tokens, elapsed)  # about one slice's cost

    def steer_slices(self, session: str, tokens: int, elapsed: float) -> None:
        """After a full slice of ``tokens`` positions of ``session`` (a prefill's, or a replay's)
        ran alone in ``elapsed`` seconds, size the next toward its target time. A slice costs a
        fixed part (the weights are read once) plus a part per token, so the size is corrected
        by the ratio of target to measured time, at most 2x per step."""
        mode = self.slice_mode(session)
        n = self.slice_tokens[mode]
        if tokens < int(n):
            return  # a whole short prompt or a remainder says little about a slice's cost
        target = IDLE_SLICE_S if mode == "idle" else (
            self.config.prefill_slice or max(MIN_SLICE_S, SLICE_PER_DECODE * (self.decode_batch_s or 0.0)))
        size = tokens * min(2.0, max(0.5, target / elapsed))
        self.slice_tokens[mode] = min(MAX_SLICE_TOKENS, max(MIN_SLICE_TOKENS, size))

    def steer_ride(self, work: Work, added: float) -> None:
        """After a slice rode a decode batch, adding ``added`` seconds to its pass, size the
        next to add RIDE_PER_DECODE of a decode batch's time. What a slice adds is its own
        tokens' cost, about proportional to them (growing with the context they attend to),
        so the size follows a moving average of the cost per token: a pass's noise moves it
        a little, not twofold."""
        n = self.slice_tokens["ride"]
        if work.tokens < int(n) or self.decode_batch_s is None:
            return  # a remainder says little; nor does a pass whose decode part's time is unknown
        self.ride_token_s = _average(self.ride_token_s, max(added, 1e-6) / work.tokens, 0.3)
        size = (self.config.prefill_slice or RIDE_PER_DECODE * self.decode_batch_s) / self.ride_token_s
        self.slice_tokens["ride"] = min(MAX_SLICE_TOKENS, max(MIN_SLICE_TOKENS, n / 2, min(2 * n, size)))
