"""Speculation at the head: drafts by prompt lookup, and how many to send. No sockets, no torch.

Every token of a stream pays one trip through every hop. A head that guesses the next few
tokens sends them with the last one as one step (FORWARD ``drafts``); each hop runs the
step as a small prefill, and the tail keeps the drafts it would have sampled itself and
answers the token after them (fabric/node/asks.py ``verify``), so one trip yields from one
to len(drafts) + 1 tokens and the text is the text of one-token steps.

The guesses need no second model: text that repeats (code, a list, a quoted paragraph, a
random model's loop) repeats its own n-grams. ``Lookup`` finds the longest n-gram (3 tokens
down to 1) that ends the history and occurred earlier in it, prompt included, and proposes
what followed its latest occurrence.

``Speculation`` decides per session how many drafts a step carries (``k``), by what a trip
yields against what it costs:

- yield: a step's first draft is kept with a probability ``a``, and each later one, once the
  ones before it were, with ``b`` (drafts hold in runs: b is mostly above a): moving averages
  per length of the n-gram match that proposed the drafts (after a 3-gram a copy goes on;
  after a 1-gram in open chat it seldom does). A session starts from its head's figures
  (``DraftYield``, learnt from every request the head heads), so a crowd of chat requests does
  not each pay to find out. A step of k drafts yields E(k) = 1 + a (1 + b + ... + b^(k-1)).
- cost: the head times its own steps, sent to answered: a plain step's trip is the route's
  round trip (every link's latency, and every hop's compute of one position); a verification
  step's trip is longer by the compute of its extra positions, ``d`` seconds per draft. The
  draft's cost is a share of the trip, c = d / trip. While the head heads n requests, the
  hops' passes are shared by n streams, and a draft's compute delays each of them, so c
  counts n times.

k is the one of 0..max_drafts with the most tokens per unit of trip, E(k) / (1 + k c). On a
fast route (loopback, a GPU: the trip is mostly compute) c is large and k small; over a LAN
the trip is mostly waiting, c is small and k large; a draft pays at all only where a > c.
A session that has not drafted for ``pause_steps`` decode steps probes with one draft after
a 3-gram match (its text may have turned repetitive); a probe that fails doubles the wait.
Only a session its head heads alone probes: in a pass shared by other streams a probe's
position is compute taken from them, with no idle time to hide in (8 streams on loopback
probed about 30 times in 4,000 tokens for a handful kept).

A head with a draft model (``--draft``, fabric/node/draft_model.py) has a second source: the
model's guesses, with a yield of their own (the slot after the n-grams') and a cost that adds
the model's own time per draft, spent at the head before the step leaves, to the hops'. The
head's time, like the hops', is every stream's: while it runs the model, the other requests it
heads wait, so it counts n times too. Each step takes the source with the most tokens per unit
of trip: prompt lookup where it has a match that pays (a copy), else the model; neither where
neither pays. A useless draft model (its drafts seldom kept) is switched off by the same rule
and probed now and then, where even drafts always kept would pay. A model that sat out steps
(plain, or lookup's) must first be fed what it missed: a step that drafts on from there repays
that once over the steps that follow, but a probe, a single step, pays it alone, so a probe
counts it (40 tokens fed are some 50 ms; with 8 streams, 3 of their trips). The model's times
(``DraftTiming``) are the head's, learnt by every request it heads, as the yields are.

Pipelined (``ahead``): while a step's answer is on its way back, the head may send the next
step too, assuming every draft in flight kept and guessing the token after them: what lookup
proposes there, or the draft model, drafting on from its own drafts while the step before is
on its way (its time hides in the trip). Where both held, that step's tokens follow the
first's without a trip of their own; where not, the tail answers nothing for it and the next
step cuts its positions off. Worth it where the drafts likely hold (first * then^k, the guess
counted as one more in the run) and only where a trip is mostly waiting: on a route that
leaves the head's machine (fabric/node/route_session.py decides that), for a request its head
heads alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ..wire.protocol import MAX_DRAFTS

MAX_NGRAM = 3  # the longest n-gram looked up; shorter ones are tried after it, down to one token
MODEL = MAX_NGRAM + 1  # the draft model's place among the sources (n-grams of 1..MAX_NGRAM tokens, then it)
AHEAD = ("auto", "on", "off")  # when a step is sent ahead of its answer (SpeculationConfig.ahead)
MAX_PROBE_AFTER = 512  # decode steps between probes at most, however often they failed


@dataclass(frozen=True)
class SpeculationConfig:
    enabled: bool = True  # the head drafts for the requests it heads (``--speculate off`` turns it off)
    max_drafts: int = 6  # drafts one step carries at most (<= MAX_DRAFTS)
    first_drafts: int = 3  # drafts of a step while nothing is measured (``adaptive`` False: the walk's start)
    adaptive: bool = True  # k by yield against cost (above); False: every step drafts, one more after a step
    # whose drafts all held, what held and one after a rejection (tests use it to draft whatever happens)
    pause_steps: int = 32  # decode steps without a draft before a probe (one draft after a 3-gram match)
    smoothing: float = 0.2  # weight of the newest step in the moving averages of yield and cost
    prior_accept: float = 0.5  # the chance a draft is kept (first, and then), until a head's requests measure it
    # a draft's cost as a share of a plain trip, until both are timed, and at least: in a pass shared by many
    # streams a verification's few extra positions hide in the noise, and a cost of 0 would make any draft pay
    min_cost: float = 0.05
    # pipelined speculation: while a step's answer is on its way, send the next (``ahead``) where its drafts
    # are likely kept: "auto" on routes that leave the head's machine, "on" on any route, "off" never
    ahead: str = "auto"

    def __post_init__(self):
        if not 1 <= self.max_drafts <= MAX_DRAFTS or not 1 <= self.first_drafts <= self.max_drafts:
            raise ValueError(f"drafts per step must be in [1, {MAX_DRAFTS}]")
        if self.ahead not in AHEAD:
            raise ValueError(f"ahead is one of {', '.join(AHEAD)}")


def tokens_per_trip(first: float, then: float, k: int) -> float:
    """E(k): the tokens a step of ``k`` drafts yields when the first is kept with probability
    ``first`` and each later one, once the ones before it were, with ``then`` (the tail always
    adds one)."""
    return 1 + first * sum(then ** i for i in range(k))


def best_drafts(first: float, then: float, cost: float, max_drafts: int, fixed: float = 0.0) -> int:
    """The k of 0..max_drafts with the most tokens per unit of trip, E(k) / (1 + fixed + k cost)
    (``cost``: one draft's share of a plain trip; ``fixed``: a drafting step's share beyond its
    drafts, none for k = 0); the smallest such k on a tie."""
    return max(range(max_drafts + 1), key=lambda k: (trip_value(first, then, k, cost, fixed), -k))


def trip_value(first: float, then: float, k: int, cost: float, fixed: float = 0.0) -> float:
    """Tokens per unit of a plain trip of a step of ``k`` drafts (``best_drafts``)."""
    return tokens_per_trip(first, then, k) / (1 + (fixed if k else 0.0) + k * cost)


class Drafter(Protocol):
    """A draft model, bound to one session (fabric/node/draft_model.py)."""

    def propose(self, history: list[int], k: int) -> tuple[list[int], list]:
        """Up to ``k`` drafts after ``history``, and the distribution each was drawn from (a
        sampling request's DraftDists; [] for point masses)."""
        ...

    def close(self) -> None: ...  # the session ended: its draft KV goes


class Lookup:
    """An n-gram index over a growing token history: for each n-gram (1..MAX_NGRAM tokens),
    the index just past its latest occurrence that is not the history's end. Appending is
    amortized O(MAX_NGRAM) per token; its size is bounded by the history's (the context)."""

    def __init__(self):
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self._indexed = 0  # n-grams ending before this index are in ``_after``

    def propose(self, history: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the history's last
        n-gram. A match close to the end repeats its period (a loop continues as a loop)."""
        n, at = self._match(history)
        if k <= 0 or not n:
            return []
        period = len(history) - at
        return [history[at + i % period] for i in range(k)]

    def match_length(self, history: list[int]) -> int:
        """The length of the longest n-gram ending the history that occurred earlier (0: none):
        the longer, the likelier what followed it comes again."""
        return self._match(history)[0]

    def _match(self, history: list[int]) -> tuple[int, int]:
        """(n, index of what followed the n-gram's latest earlier occurrence), (0, -1) for none;
        the history's new tokens are indexed first."""
        end = len(history)
        for stop in range(max(self._indexed, 1), end):  # n-grams ending at stop - 1, followed by history[stop]
            for n in range(1, min(MAX_NGRAM, stop) + 1):
                self._after[tuple(history[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            at = self._after.get(tuple(history[end - n:]))
            if at is not None:
                return n, at
        return 0, -1


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class DraftYield:
    """The chance a step's first draft is kept (``first``) and the chance a later one is, once
    the ones before it were (``then``), per length of the n-gram that proposed them (index
    n - 1; index MODEL - 1: the draft model's), as moving averages. Two, not one: drafts hold in runs (a quoted phrase, a line of
    code that comes back), so after a kept draft the next is likelier kept than the first
    was. A head keeps one that every session it heads learns into, and each session starts
    from a copy of it: a request starts from what the head's recent requests found (chat,
    seldom kept after a 1-gram match; a copy, nearly always after a 3-gram), and then follows
    its own text."""

    first: list[float]
    then: list[float]

    @classmethod
    def prior(cls, config: SpeculationConfig) -> "DraftYield":
        return cls([config.prior_accept] * MODEL, [config.prior_accept] * MODEL)

    def copy(self) -> "DraftYield":
        return DraftYield(list(self.first), list(self.then))

    def learn(self, n: int, drafted: int, kept: int, smoothing: float) -> None:
        """A step of ``drafted`` drafts after an n-gram of ``n`` kept ``kept``: a draw of "is the
        first kept", and, after it, one of "is the next kept" per later draft it answered (each
        kept one, and the miss), each moving its average by ``smoothing``."""
        self.first[n - 1] = _average(self.first[n - 1], float(kept > 0), smoothing)
        if kept:
            for kept_it in [1.0] * (kept - 1) + [0.0] * (kept < drafted):
                self.then[n - 1] = _average(self.then[n - 1], kept_it, smoothing)


@dataclass
class DraftTiming:
    """What a head's draft model costs, as moving averages learnt by every request the head
    heads (a new one starts from them): its time per draft (one token's pass: the first feeds
    the tail's token, the rest each the draft before), per token it is fed to catch up with a
    history it did not follow (a pass over many tokens: far less per token than a draft), and
    the route's plain trip, which a new request weighs those against until it has timed its own;
    and what a draft cost the hops in a pass shared with other streams (``crowd``), which a new
    request in a crowd counts until it has timed its own drafts: in such a pass one draft can
    cost far more than its position (8 rows of float32 and a verification's 2 positions: 9 rows,
    1.36x the 8 rows' pass on one CPU's matrix kernels, docs/BENCHMARKS.md)."""

    model_s: float | None = None  # seconds per draft, from steps that follow one of the model's own
    feed_s: float | None = None  # seconds per token fed to catch up (a chunk: far less than a draft's)
    plain_s: float | None = None  # a plain step's trip, of the requests the head heads lately
    crowd: float | None = None  # a draft's cost at the hops as a share of a plain trip, timed in shared passes

    def learn(self, spent: float, drafts: int, fed: int, smoothing: float) -> None:
        """A call of ``spent`` seconds drafted ``drafts`` after catching up ``fed`` tokens (0:
        it followed one of its own, bar the tail's token and what the tail rejected). Catching
        up is one pass over the ``fed`` tokens, which gives the first draft; each later draft is
        a pass of its own (a draft's time where known, else as much as a token fed)."""
        if not fed:
            self.model_s = _average(self.model_s, spent / drafts, smoothing)
            return
        if self.model_s is None:
            self.feed_s = _average(self.feed_s, spent / (fed + drafts - 1), smoothing)
            return
        self.feed_s = _average(self.feed_s, max(0.0, spent - (drafts - 1) * self.model_s) / fed, smoothing)


@dataclass
class Speculation:
    """One session's drafting: how many to send next (``drafts``), learning from each step's
    answer (``answered``). The counts (steps, trips, drafted, kept) are what reports show."""

    config: SpeculationConfig
    shared: DraftYield | None = None  # its head's, learnt into too; None: a yield of its own from the prior
    lookup: Lookup = field(default_factory=Lookup)
    drafter: Drafter | None = None  # the head's draft model for this session; None: prompt lookup alone
    timing: DraftTiming = field(default_factory=DraftTiming)  # the draft model's costs: its head's, learnt into
    yields: DraftYield | None = None  # its own, from a copy of ``shared`` (or the prior)
    size: int = 0  # drafts the next step may carry (``adaptive`` False)
    plain_s: float | None = None  # moving average of a plain step's trip, seconds (None: none timed yet)
    draft_s: float | None = None  # ...and of what a verification step's trip took beyond it, per draft
    model_at: int = -1  # the history's length when the draft model last drafted (-1: never)
    streams: int = 1  # requests its head heads now (set by the head): they share the hops' passes
    matched: int = 0  # the source of the pending step's drafts: its n-gram's length, or MODEL
    q: list = field(default_factory=list)  # the pending step's drafts' distributions (a draft model's, sampling)
    idle: int = 0  # decode steps since this session last drafted
    probe_after: int = 0  # idle steps before a probe (one draft after a 3-gram), doubled while probes fail
    probing: bool = False  # the pending step is such a probe
    stopped: bool = False  # a hop could not cut drafted positions off: no more drafts
    steps: int = 0  # decode steps answered, plain or not: trips through the route
    trips: int = 0  # verification steps answered
    drafted: int = 0  # drafts sent in them
    kept: int = 0  # drafts kept of those
    aheads: int = 0  # steps sent ahead of the answer before them (``ahead``)
    aheads_held: int = 0  # those whose guess held: the tail ran them

    def __post_init__(self):
        self.size = self.size or self.config.first_drafts
        self.probe_after = self.probe_after or self.config.pause_steps
        if self.yields is None:
            self.yields = self.shared.copy() if self.shared is not None else DraftYield.prior(self.config)

    @property
    def cost(self) -> float:
        """A draft's cost at the hops as a share of a plain trip (c, above), counted once per
        stream. At least ``min_cost`` while the head heads more than one request (a pass shared
        by many streams times a draft's few positions as noise); one stream's timing is its own. A
        request in a crowd that has not timed a draft yet counts what its head's others timed."""
        own = self.draft_s / self.plain_s if self.plain_s and self.draft_s is not None else None
        if self.streams <= 1:
            return self.config.min_cost if own is None else own
        timed = own if own is not None else self.timing.crowd
        return max(self.config.min_cost, timed or 0.0) * self.streams

    @property
    def model_cost(self) -> float:
        """A draft model's draft: the hops' cost and the model's own time, as a share of a plain trip."""
        t, trip = self.timing, self._trip
        own = t.model_s / trip if trip and t.model_s is not None else self.config.min_cost
        return self.cost + own * max(1, self.streams)

    def catch_up_cost(self, history: list[int]) -> float:
        """The draft model's time to be fed what it missed of ``history`` (0 where it drafted the
        step before), as a share of a plain trip, once per stream; 0 until timed (the first
        catching up times it)."""
        t, behind, trip = self.timing, self._behind(history), self._trip
        if not behind or t.feed_s is None or not trip:
            return 0.0
        return behind * t.feed_s / trip * max(1, self.streams)

    @property
    def _trip(self) -> float | None:
        """A plain trip, to weigh the draft model's time against: the session's own, else (its
        first steps) its head's recent requests'."""
        return self.plain_s or self.timing.plain_s

    def _behind(self, history: list[int]) -> int:
        """Tokens of ``history`` the draft model must be fed before it drafts: 0 where it drafted
        the step before (it then holds all but the tail's token and what the tail rejected)."""
        behind = len(history) - max(self.model_at, 0)
        return 0 if self.model_at >= 0 and behind <= self.config.max_drafts + 1 else behind

    def drafts(self, history: list[int], room: int) -> list[int]:
        """The drafts for the step after ``history``, at most ``room`` (tokens the request may
        still take, less the one every step yields); [] for a plain one-token step. A draft
        model's distributions for them, if any, are left in ``q``."""
        n = self.lookup.match_length(history)  # indexes the new tokens, drafting or not
        self.q = []
        if self.stopped or room <= 0:
            return []
        if not self.config.adaptive:
            self.matched = MODEL if self.drafter is not None and n < MAX_NGRAM else n
            if self.matched == MODEL:
                return self._model(history, min(self.size, room))
            return self.lookup.propose(history, min(self.size, room))
        source, k = self._best(n)
        if source == MODEL and self.plain_s is None and self.trips:
            return []  # the model's own time counts against a plain trip: time one before drafting on
        if k == 0:
            self.idle += 1
            if self.idle < self.probe_after or self.streams > 1 or (source := self._probe(n, history)) == 0:
                return []
            k, self.probing = 1, True  # none paid lately: try one
        self.matched = source
        if source == MODEL:
            return self._model(history, min(k, room))
        return self.lookup.propose(history, min(k, room))

    def _best(self, n: int) -> tuple[int, int]:
        """(source, k) with the most tokens per unit of trip: the n-gram match (if any) at the
        hops' cost, the draft model (if any) at its own; k 0 where no draft pays."""
        y, best = self.yields, (0, 0, 1.0)  # (source, k, tokens per unit of trip)
        for source, cost in ((n, self.cost), (MODEL, self.model_cost if self.drafter else None)):
            if not source or cost is None:
                continue
            first, then = y.first[source - 1], y.then[source - 1]
            k = best_drafts(first, then, cost, self.config.max_drafts)
            value = trip_value(first, then, k, cost)
            if k and value > best[2]:
                best = (source, k, value)
        return best[0], best[1]

    def _probe(self, n: int, history: list[int]) -> int:
        """The source to probe with one draft: lookup after a 3-gram match (its text may have turned
        repetitive), else the draft model if even drafts always kept would pay at its cost, its
        catching up with what it missed included (a probe pays it alone); 0: none."""
        if n == MAX_NGRAM:
            return n
        if self.drafter is not None and best_drafts(1.0, 1.0, self.model_cost, self.config.max_drafts,
                                                    self.catch_up_cost(history)):
            return MODEL
        return 0

    def _model(self, history: list[int], k: int) -> list[int]:
        """The draft model's ``k`` drafts, timed: its time per draft learnt from steps that follow
        one of its own; a first step, or one after steps it sat out, first feeds it every token it
        missed (the prompt, those steps' tokens), which teaches its time per token fed."""
        started, behind = time.perf_counter(), self._behind(history)
        drafts, self.q = self.drafter.propose(history, k)
        if drafts:
            self.timing.learn(time.perf_counter() - started, len(drafts), behind, self.config.smoothing)
        self.model_at = len(history)
        return drafts

    def ahead(self, history: list[int], drafts: list[int], room: int, greedy: bool = True) -> list[int]:
        """The step to send before the one just sent (``drafts`` after ``history``) is answered:
        a guess of the token the tail answers after those drafts, and drafts after it, for at
        most ``room`` tokens; [] where none pays. The step holds where every one of ``drafts``
        is kept and the guess too, a chance of first * then^k; it then yields E(m) tokens with
        no trip of their own, and its m + 1 positions cost the hops m + 1 drafts either way.
        Only a session its head heads alone sends one: in a pass shared by other streams the
        positions of a step that did not hold are compute taken from them. Drafts from the
        draft model go on from its own (its distributions left in ``q``), for a greedy request
        only (a sampled guess seldom is the tail's draw), as many as its time fits in a trip."""
        c = self.config
        model = self.matched == MODEL
        if c.ahead == "off" or self.stopped or self.streams > 1 or not drafts or room < 2 or (model and not greedy):
            return []
        m = min(room - 1, c.max_drafts)
        if model:
            m = min(m, self._fits_in_trip())
        if c.adaptive:
            first, then = self.yields.first[self.matched - 1], self.yields.then[self.matched - 1]
            m = min(m, best_drafts(then, then, self.cost, c.max_drafts))
            if first * then ** len(drafts) * tokens_per_trip(then, then, m) <= (m + 1) * self.cost:
                return []
        if m < 1:
            return []
        if model:
            ids = self._model(history + drafts, m + 1)
            self.q = self.q[1:]  # the guess is a point: only its drafts carry their q
        else:
            ids = self.lookup.propose(history, len(drafts) + 1 + m)
            if ids[:len(drafts)] != drafts:
                return []  # lookup no longer continues the drafts in flight
            ids = ids[len(drafts):]
        if len(ids) < 2:
            return []
        self.aheads += 1
        return ids

    def _fits_in_trip(self) -> int:
        """Drafts after a guess that the draft model makes in a plain trip's time (it makes
        them at the head while the step before is on its way): all while untimed."""
        trip, draft = self._trip, self.timing.model_s
        return self.config.max_drafts if not trip or not draft else int(trip / draft) - 1

    def answered(self, drafted: int, kept: int, trip_s: float | None) -> None:
        """A decode step came back after ``trip_s`` seconds: ``kept`` of its ``drafted`` drafts
        held (drafted 0: a plain step). Learn the yield and the cost; size the next step. A step
        sent ahead has no trip of its own (None): it teaches the yield alone."""
        c = self.config
        self.steps += 1
        if not drafted:
            self.plain_s = _average(self.plain_s, trip_s, c.smoothing)
            self.timing.plain_s = _average(self.timing.plain_s, trip_s, c.smoothing)
            return
        if self.plain_s is not None and trip_s is not None:
            self.draft_s = _average(self.draft_s, max(0.0, trip_s - self.plain_s) / drafted, c.smoothing)
            if self.streams > 1:
                self.timing.crowd = _average(self.timing.crowd, self.draft_s / self.plain_s, c.smoothing)
        self.trips, self.drafted, self.kept = self.trips + 1, self.drafted + drafted, self.kept + kept
        if self.matched:
            for yields in filter(None, (self.yields, self.shared)):
                yields.learn(self.matched, drafted, kept, c.smoothing)
        if self.probing:  # a probe that failed waits twice as long for the next
            self.probe_after = c.pause_steps if kept else min(self.probe_after * 2, MAX_PROBE_AFTER)
        self.idle, self.probing = 0, False
        self.size = min(c.max_drafts, self.size + 1) if kept == drafted else max(1, kept + 1)

    def stop(self) -> None:
        """No more drafts for this session (a hop could not cut its KV back)."""
        self.stopped = True

    def close(self) -> None:
        """The request ended: the draft model's KV for it goes."""
        if self.drafter is not None:
            self.drafter.close()


def speculation_counts(spec: Speculation | None) -> dict[str, int]:
    """A request's REPORT fields: decode trips, drafts sent and kept (none where it drafts nothing)."""
    if spec is None or not spec.trips:
        return {}
    return {"trips": spec.steps, "drafted": spec.drafted, "kept": spec.kept}
