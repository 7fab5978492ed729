"""Reports from heads: progress of the requests they serve, and each one's end, which the
ledger bills once and the statistics learn from. Every change is an event on the feed."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from fabric.wire.protocol import Ack, Message, Report

from .events import EventRing
from .ledger import Ledger, check_report
from .planner import (
    CostModel,
    estimate_route,
    hop_dict,
    hop_weights,
    links_measured,
    route_link_seconds,
)
from .registry import Registry
from .stats import Completion, StatsStore, decode_timing

MAX_INFLIGHT = 4096  # requests whose first progress report is remembered


def _progress_line(msg: Report, tps: float) -> str:
    """The progress event's one line: the prefill while one runs, else the tokens so far."""
    if msg.prefilled < msg.prefill_tokens:
        return f"prefill {msg.prefilled} / {msg.prefill_tokens} tokens"
    return f"{msg.completion_tokens} tokens · {tps:.1f} tok/s"


class Reports:
    def __init__(self, registry: Registry, stats: StatsStore, events: EventRing, cost: CostModel,
                 emit: Callable[[dict], None]):
        self.registry, self.stats, self.events, self.cost = registry, stats, events, cost
        self.emit = emit  # publishes an event on the feed
        # request id -> (tokens, seconds) at its first progress report with tokens (None before)
        self._inflight: OrderedDict[str, tuple[int, float] | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._inflight)

    def handle(self, msg: Report, ledger: Ledger) -> Message:
        check_report(msg)
        return self._on_completion(msg, ledger) if msg.final else self._on_progress(msg)

    def _remember(self, request_id: str, first: tuple[int, float] | None) -> None:
        self._inflight[request_id] = first
        while len(self._inflight) > MAX_INFLIGHT:
            self._inflight.popitem(last=False)

    def _on_progress(self, msg: Report) -> Message:
        rid = msg.request_id
        if rid not in self._inflight:
            self._remember(rid, None)
            self.emit(self.events.add(
                "connected", f"{msg.node_id} connected for {msg.model}", key=rid,
                node=msg.node_id, model=msg.model, hops=[hop_dict(h) for h in msg.route]))
        if msg.completion_tokens > 0 or msg.prefilled > 0:  # tokens come, or a long prompt prefills
            tps = self._decode_tps(msg) if msg.completion_tokens > 0 else 0.0
            head = self.registry.get(msg.node_id)
            self.emit(self.events.upsert(
                "progress", rid, _progress_line(msg, tps),
                node=msg.node_id, model=msg.model, tokens=msg.completion_tokens,
                tps=round(tps, 3), queue=head.queued if head else 0, elapsed=msg.elapsed,
                prefilled=msg.prefilled, prefill_tokens=msg.prefill_tokens))
        return Ack()

    def _decode_tps(self, msg: Report) -> float:
        """Decode tokens per second since the request's first report with tokens."""
        if self._inflight[msg.request_id] is None:
            self._inflight[msg.request_id] = (msg.completion_tokens, msg.elapsed)
        timing = decode_timing(msg.completion_tokens, msg.elapsed, self._inflight[msg.request_id])
        return 1.0 / timing.seconds_per_token if timing else 0.0

    def _on_completion(self, msg: Report, ledger: Ledger) -> Message:
        first = self._inflight.pop(msg.request_id, None)
        entry, new = ledger.record(msg)
        if not new:
            return Ack(detail=f"already recorded: {entry.status}", request_id=msg.request_id)
        self._record_stats(msg, first)
        kind = "error" if msg.finish_reason == "error" else "complete"
        billing = entry.status + (f" ({entry.reason})" if entry.reason else "")
        self.emit(self.events.add(
            kind, f"{msg.model}: {msg.prompt_tokens} in / {msg.completion_tokens} out in "
            f"{msg.elapsed:.2f}s, {msg.finish_reason}, {billing}", key=msg.request_id,
            node=msg.node_id, model=msg.model, prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens, duration=msg.elapsed,
            finish_reason=msg.finish_reason, billing=entry.status, billing_reason=entry.reason,
            hops=[hop_dict(h) for h in msg.route]))
        return Ack(detail=billing, request_id=msg.request_id)

    def _record_stats(self, msg: Report, first: tuple[int, float] | None) -> None:
        nodes = {n.node_id: n for n in self.registry.snapshot(everyone=True)}
        rates, cost = self.stats.layer_rates(), self.cost
        self.stats.record(
            Completion(model=msg.model, route=msg.route, completion_tokens=msg.completion_tokens,
                       elapsed=msg.elapsed, finish_reason=msg.finish_reason, first_progress=first),
            hop_weights=hop_weights(msg.route, nodes, rates, cost),
            link_s=route_link_seconds(msg.route, nodes, cost),
            predicted_s=estimate_route(msg.route, nodes, rates, cost),
            min_compute_share=0.1 if links_measured(msg.route, nodes) else 0.5)
