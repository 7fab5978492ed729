"""Rolling performance statistics: pure timing functions plus a small in-memory store.

What is measured, per completed request (a final ``Report``):

- decode seconds per token of the route, and time to first token when the head sent a
  progress report after its first token (see ``decode_timing``);
- per (node, model): layer-steps/s and the seconds per token spent in that node's hop.
  The wire carries no per-hop timings, so a route's measured decode time (less the
  planner's link estimate) is *attributed* to its hops in proportion to their
  predicted compute time;
- per route: predicted vs actual tokens/s.

Hygiene: completions with fewer than ``MIN_THROUGHPUT_TOKENS`` output tokens, or that
ended in an error, never feed throughput -- a broken route that emits one token
instantly must not look fast.

Trust: the store learns only what the caller vouched for (``tracker.reports`` passes on
completions of registered heads over registered nodes of the model), and one reporter
is one vote in a node's layer rate (``combine_heads``). Every table has a named bound.
"""
from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from fabric.wire.protocol import Hop

MIN_THROUGHPUT_TOKENS = 8
MAX_ROUTE_KEYS = 256  # distinct routes remembered for predicted-vs-actual
MAX_STAT_ROWS = 4096  # (node, model) rows per table; a live node serves one model, so churn is what fills it
MAX_HEADS_PER_ROW = 8  # reporters one layer rate keeps a window for; the least recently heard goes first


@dataclass(frozen=True)
class Completion:
    """The facts about one finished request that statistics use."""

    model: str
    route: tuple[Hop, ...]
    completion_tokens: int
    elapsed: float  # seconds from request start to the last token
    finish_reason: str | None
    first_progress: tuple[int, float] | None = None  # (tokens, elapsed) of the first progress report with tokens


@dataclass(frozen=True)
class DecodeTiming:
    seconds_per_token: float  # decode time per output token
    ttft: float | None  # time to first token; None when it cannot be derived


def feeds_throughput(completion_tokens: int, finish_reason: str | None) -> bool:
    """Whether a completion may feed throughput: ``MIN_THROUGHPUT_TOKENS`` tokens or more, no error."""
    return completion_tokens >= MIN_THROUGHPUT_TOKENS and finish_reason != "error"


def decode_timing(completion_tokens: int, elapsed: float,
                  first_progress: tuple[int, float] | None = None) -> DecodeTiming | None:
    """Decode rate and time to first token of one request; None if nothing is measurable.

    With a progress observation of k >= 1 tokens at time t and the final n tokens at T,
    the decode rate is (n - k) / (T - t) -- prefill excluded -- and the first token came
    at t - (k - 1) * seconds_per_token. Without one, elapsed / n (prefill included). None where
    a time per token rounds to 0 (a report's elapsed of 1e-320 s): a rate is its reciprocal.
    """
    if completion_tokens <= 0 or elapsed <= 0:
        return None
    per_token, ttft = elapsed / completion_tokens, None
    if first_progress is not None:
        k, t = first_progress
        if 1 <= k < completion_tokens and 0 < t < elapsed:
            per_token = (elapsed - t) / (completion_tokens - k)
            ttft = max(0.0, t - (k - 1) * per_token)
    return DecodeTiming(per_token, ttft) if per_token > 0 else None


def attribute_hops(weights: Sequence[float], seconds: float) -> list[float]:
    """Split ``seconds`` across hops in proportion to ``weights`` (equal if all zero)."""
    total = sum(w for w in weights if w > 0)
    if total <= 0:
        return [seconds / len(weights)] * len(weights) if weights else []
    return [seconds * max(w, 0.0) / total for w in weights]


def route_label(route: Sequence[Hop]) -> str:
    """A compact, stable name for a route: ``a[0-21]>b[22-39]``."""
    return ">".join(f"{h.node}[{h.start_layer}-{h.end_layer}]" for h in route)


class Window:
    """The last ``size`` samples of one quantity."""

    def __init__(self, size: int):
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._samples.append(value)

    def __len__(self) -> int:
        return len(self._samples)

    def median(self) -> float:
        return statistics.median(self._samples) if self._samples else 0.0


def _rows(windows: dict[tuple[str, str], Window], value_name: str) -> list[dict]:
    return [{"node": node, "model": model, value_name: round(w.median(), 6), "samples": len(w)}
            for (node, model), w in sorted(windows.items())]


def combine_heads(rates: Sequence[float]) -> float:
    """One (node, model) layer rate from each reporting head's own median: the lower median.

    One head, one vote: a head that floods reports fills its own window only, not the
    node's. With three or more heads the lower median lies between two honest heads'
    figures, whatever one head claims; with two it is the slower claim, so a lone liar can
    make a node look slower (the planner then uses others) but never faster than an honest
    head measured it -- it cannot pull every plan through itself or a friend. Measured on
    this store (a node honest heads saw at 9.7, 10 and 10.3 layer-steps/s; one more head
    sends 1,000 reports): a claim of 10^5 leaves the rate at 10, also beside one honest
    head alone; a claim of 0.01 leaves it at 9.7, and sets it to 0.01 beside one honest
    head. The old store (one window of 64 samples per node) followed the liar either way
    after 64 reports. A single reporter is all there is to go on.
    """
    return statistics.median_low(rates) if rates else 0.0


def _row(table: OrderedDict, key, make, limit: int = MAX_STAT_ROWS):
    """``table[key]`` (made by ``make`` if new), now the most recently used; the least
    recently used row goes once the table holds more than ``limit``."""
    row = table.pop(key, None)
    table[key] = row = make() if row is None else row
    while len(table) > limit:
        table.popitem(last=False)
    return row


class _HeadWindows:
    """One rolling window per reporting head (``MAX_HEADS_PER_ROW`` at most)."""

    def __init__(self, size: int):
        self.size = size
        self.heads: OrderedDict[str, Window] = OrderedDict()

    def add(self, value: float, head: str = "") -> None:
        _row(self.heads, head, lambda: Window(self.size), MAX_HEADS_PER_ROW).add(value)

    def __len__(self) -> int:
        return sum(len(w) for w in self.heads.values())

    def median(self) -> float:
        return combine_heads([w.median() for w in self.heads.values() if len(w)])


class _RouteRecord:
    def __init__(self, model: str, route: tuple[Hop, ...], size: int):
        self.model, self.route = model, route
        self.predicted, self.actual = Window(size), Window(size)

    def row(self) -> dict:
        return {"model": self.model, "route": route_label(self.route),
                "predicted_tps": round(self.predicted.median(), 3),
                "actual_tps": round(self.actual.median(), 3), "samples": len(self.actual)}


class StatsStore:
    """Rolling windows of the statistics above. Owned by one thread (the service loop)."""

    def __init__(self, window: int = 64):
        self.window = window
        self._layer_rate: OrderedDict[tuple[str, str], _HeadWindows] = OrderedDict()
        self._hop_seconds: OrderedDict[tuple[str, str], Window] = OrderedDict()
        self._decode_tps: OrderedDict[tuple[str, str], Window] = OrderedDict()
        self._ttft: OrderedDict[tuple[str, str], Window] = OrderedDict()
        self._routes: OrderedDict[tuple, _RouteRecord] = OrderedDict()
        self._rates: dict[tuple[str, str], float] | None = None  # layer_rates(), until the next change
        self.counts = {"completions": 0, "fed": 0, "too_short": 0, "errors": 0}
        self.refused = 0  # completions the caller would not vouch for (see ``refuse``)

    def _add(self, table: OrderedDict, key: tuple[str, str], value: float) -> None:
        _row(table, key, lambda: Window(self.window)).add(value)

    def refuse(self) -> None:
        """Count a completion whose figures were not learned from (an unknown head or hop)."""
        self.refused += 1

    def record(self, c: Completion, hop_weights: Sequence[float] | None = None,
               link_s: float = 0.0, predicted_s: float | None = None, min_compute_share: float = 0.5,
               head: str = "") -> bool:
        """Account one completion reported by ``head``; returns True if it fed throughput statistics.

        ``hop_weights`` are predicted compute seconds per hop (for attribution),
        ``link_s`` the predicted network time per token, ``predicted_s`` the planner's
        per-token estimate for the whole route. At least ``min_compute_share`` of the
        measured time is attributed to compute: a guessed link cost must not eat it all (a
        measured one may take more). ``head`` names the reporter (its key in a secured
        swarm): its figures are one vote in each hop's layer rate.
        """
        self.counts["completions"] += 1
        if c.finish_reason == "error":
            self.counts["errors"] += 1
            return False
        timing = decode_timing(c.completion_tokens, c.elapsed, c.first_progress)
        if timing is not None and timing.ttft is not None and c.route:
            self._add(self._ttft, (c.route[0].node, c.model), timing.ttft)
        if timing is None or not c.route or not feeds_throughput(c.completion_tokens, c.finish_reason):
            self.counts["too_short"] += 1
            return False
        self.counts["fed"] += 1
        self._record_hops(c, timing.seconds_per_token, hop_weights, link_s, min_compute_share, head)
        self._record_route(c, timing.seconds_per_token, predicted_s)
        return True

    def _record_hops(self, c: Completion, seconds: float, weights: Sequence[float] | None,
                     link_s: float, min_compute_share: float = 0.5, head: str = "") -> None:
        compute = max(seconds - link_s, seconds * min_compute_share)
        layers = [h.end_layer - h.start_layer + 1 for h in c.route]
        shares = attribute_hops(weights if weights and len(weights) == len(c.route) else layers, compute)
        for hop, n_layers, share in zip(c.route, layers, shares):
            key = (hop.node, c.model)
            self._add(self._hop_seconds, key, share)
            self._add(self._decode_tps, key, 1.0 / seconds)
            if share > 0:
                _row(self._layer_rate, key, lambda: _HeadWindows(self.window)).add(n_layers / share, head)
                self._rates = None

    def _record_route(self, c: Completion, seconds: float, predicted_s: float | None) -> None:
        key = (c.model, c.route)
        record = self._routes.pop(key, None) or _RouteRecord(c.model, c.route, self.window)
        self._routes[key] = record  # most recently used last
        while len(self._routes) > MAX_ROUTE_KEYS:
            self._routes.popitem(last=False)
        record.actual.add(1.0 / seconds)
        if predicted_s:
            record.predicted.add(1.0 / predicted_s)

    def route_row(self, model: str, route: Sequence[Hop]) -> dict | None:
        """Predicted vs actual tokens/s of one route (None if no request on it fed the stats)."""
        record = self._routes.get((model, tuple(route)))
        return record.row() if record is not None else None

    def layer_rates(self) -> dict[tuple[str, str], float]:
        """Measured layer-steps/s per (node, model), for the planner (kept until the next
        change: every route request asks)."""
        if self._rates is None:
            self._rates = {k: w.median() for k, w in self._layer_rate.items() if len(w)}
        return self._rates

    def forget_node(self, node_id: str) -> None:
        """Drop a node's measurements (it left, expired, or re-registered with another build)."""
        for table in (self._layer_rate, self._hop_seconds, self._decode_tps, self._ttft):
            for key in [k for k in table if k[0] == node_id]:
                del table[key]
        self._rates = None

    def rows(self) -> int:
        """Rows held across the per-(node, model) tables (for tests and /metrics)."""
        return sum(len(t) for t in (self._layer_rate, self._hop_seconds, self._decode_tps, self._ttft))

    def snapshot(self) -> dict:
        """A msgpack/JSON-friendly view for Status and the ``stats`` topic."""
        return {
            "window": self.window,
            "layer_steps_per_s": _rows(self._layer_rate, "layer_steps_per_s"),
            "decode_tps": _rows(self._decode_tps, "tokens_per_s"),
            "ttft": _rows(self._ttft, "seconds"),
            "hop_latency": _rows(self._hop_seconds, "seconds"),
            "routes": [r.row() for r in self._routes.values()],
            "counts": dict(self.counts),
            "refused": self.refused,
        }
