"""Speculation at the head: drafts by prompt lookup, and when a session stops drafting. No sockets, no torch.

Every token of a stream pays one trip through every hop. A head that guesses the next few
tokens sends them with the last one as one step (FORWARD ``drafts``); each hop runs the
step as a small prefill, and the tail keeps the drafts it would have sampled itself and
answers the token after them (fabric/node/asks.py ``verify``), so one trip yields from one
to len(drafts) + 1 tokens and the text is the text of one-token steps.

The guesses need no second model: text that repeats (code, a list, a quoted paragraph, a
random model's loop) repeats its own n-grams. ``Lookup`` finds the longest n-gram (3 tokens
down to 1) that ends the history and occurred earlier in it, prompt included, and proposes
what followed its latest occurrence. ``Speculation`` decides per session how many to send:
more after a step whose drafts all held, fewer after a rejection, and none for a while when
the average share kept falls low (a verification costs the hops its extra positions: on a
CPU, compute; across a LAN, nearly nothing), and none while its head heads more than a few
requests: then the hops' compute is what limits, and drafts that fail take it from the others
(measured: 8 streams on 2 cores lost a quarter of their aggregate tok/s with drafts).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..wire.protocol import MAX_DRAFTS

MAX_NGRAM = 3  # the longest n-gram looked up; shorter ones are tried after it, down to one token


@dataclass(frozen=True)
class SpeculationConfig:
    enabled: bool = True  # the head drafts for the requests it heads (``--speculate off`` turns it off)
    max_drafts: int = 6  # drafts one step carries at most (<= MAX_DRAFTS)
    first_drafts: int = 3  # drafts of a session's first verification
    min_rate: float = 0.3  # a session whose average share of drafts kept falls below this stops drafting...
    pause_steps: int = 32  # ...for this many steps, then tries again
    smoothing: float = 0.3  # weight of the newest verification in that average
    max_streams: int = 2  # a head heading more requests than this drafts for none (compute has no slack left)

    def __post_init__(self):
        if not 1 <= self.max_drafts <= MAX_DRAFTS or not 1 <= self.first_drafts <= self.max_drafts:
            raise ValueError(f"drafts per step must be in [1, {MAX_DRAFTS}]")


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
        end = len(history)
        for stop in range(max(self._indexed, 1), end):  # n-grams ending at stop - 1, followed by history[stop]
            for n in range(1, min(MAX_NGRAM, stop) + 1):
                self._after[tuple(history[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            at = self._after.get(tuple(history[end - n:]))
            if at is not None:
                period = end - at
                return [history[at + i % period] for i in range(k)]
        return []


@dataclass
class Speculation:
    """One session's drafting: how many to send next, and whether to send any."""

    config: SpeculationConfig
    lookup: Lookup = field(default_factory=Lookup)
    size: int = 0  # drafts the next step may carry
    rate: float = 1.0  # moving average of the share of drafts kept
    paused: int = 0  # steps left without drafts
    trips: int = 0  # verification steps answered
    drafted: int = 0  # drafts sent in them
    kept: int = 0  # drafts kept of those
    crowded: bool = False  # the head heads more than max_streams requests: no drafts meanwhile

    def __post_init__(self):
        self.size = self.size or self.config.first_drafts

    def drafts(self, history: list[int], room: int) -> list[int]:
        """The drafts for the step after ``history``, at most ``room`` (tokens the request may
        still take, less the one every step yields); [] for a plain one-token step."""
        if self.paused > 0 or self.crowded:
            self.paused = max(0, self.paused - 1)
            self.lookup.propose(history, 0)  # keep the index up to date
            return []
        return self.lookup.propose(history, min(self.size, room))

    def verified(self, drafted: int, kept: int) -> None:
        """The tail kept ``kept`` of ``drafted`` drafts: size the next step, pause when it does not pay."""
        c = self.config
        self.trips, self.drafted, self.kept = self.trips + 1, self.drafted + drafted, self.kept + kept
        self.rate += c.smoothing * (kept / drafted - self.rate)
        self.size = min(c.max_drafts, self.size + 1) if kept == drafted else max(1, kept + 1)
        if self.rate < c.min_rate:
            self.paused, self.rate, self.size = c.pause_steps, c.min_rate * 2, c.first_drafts

    def stop(self) -> None:
        """No more drafts for this session (a hop could not cut its KV back)."""
        self.paused = 1 << 62
