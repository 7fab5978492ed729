"""Reports from heads: progress of the requests they serve, and each one's end, which the
ledger bills once and the statistics learn from. Every change is an event on the feed."""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from fabric.wire.protocol import Ack, Message, Report

from .events import EventRing
from fabric.wire.protocol import check_report

from .ledger import Ledger
from .node_records import NodeInfo
from .planner import (
    CostModel,
    estimate_route,
    hop_dict,
    hop_weights,
    links_measured,
    route_link_seconds,
)
from .registry import Registry
from fabric.wire.route_drafts import RouteSpeculation, rates
from .stats import Completion, StatsStore, decode_timing

log = logging.getLogger(__name__)

MAX_INFLIGHT = 4096  # requests whose first progress report is remembered


@dataclass
class _Flight:
    """A request in flight: the head that serves it, and its first progress with tokens."""

    node: str
    first: tuple[int, float] | None = None  # (tokens, seconds) at the head's first progress report with tokens


def _handed_over(msg: Report, flight: _Flight | None) -> bool:
    """Whether ``msg`` is the first word of a head that took the request over from another."""
    return (flight is None and msg.resumed > 0) or (flight is not None and flight.node != msg.node_id)


def _progress_line(msg: Report, tps: float) -> str:
    """The progress event's one line: the prefill while one runs, else the tokens so far."""
    if msg.prefilled < msg.prefill_tokens:
        return f"prefill {msg.prefilled} / {msg.prefill_tokens} tokens"
    return f"{msg.completion_tokens} tokens · {tps:.1f} tok/s{_drafts_line(msg)}"


def _drafts_line(msg: Report) -> str:
    """`` · 62% of drafts kept, 2.41 tok/trip`` for a request that drafted; "" else."""
    if not msg.drafted:
        return ""
    r = rates(msg.trips, msg.drafted, msg.kept)
    return f" · {r['acceptance']:.0%} of drafts kept, {r['tokens_per_trip']:.2f} tok/trip"


def _drafts(msg: Report) -> dict:
    """A report's speculation for its event: trips, drafts sent and kept, and their rates."""
    return {"trips": msg.trips, "drafted": msg.drafted, "kept": msg.kept, **rates(msg.trips, msg.drafted, msg.kept)}


class Reports:
    def __init__(self, registry: Registry, stats: StatsStore, events: EventRing, cost: CostModel,
                 emit: Callable[[dict], None]):
        self.registry, self.stats, self.events, self.cost = registry, stats, events, cost
        self.emit = emit  # publishes an event on the feed
        self._inflight: OrderedDict[str, _Flight] = OrderedDict()  # request id -> its head and first progress
        self.speculation = RouteSpeculation()  # drafts and trips per route, from completions

    def __len__(self) -> int:
        return len(self._inflight)

    def handle(self, msg: Report, ledger: Ledger, sender: str = "") -> Message:
        """Answer one report; ``sender`` is the key it came with (secured swarms; "" else)."""
        check_report(msg)
        return self._on_completion(msg, ledger, sender) if msg.final else self._on_progress(msg)

    def _remember(self, request_id: str, node: str) -> None:
        self._inflight[request_id] = _Flight(node)
        while len(self._inflight) > MAX_INFLIGHT:
            self._inflight.popitem(last=False)

    def _on_progress(self, msg: Report) -> Message:
        rid = msg.request_id
        flight = self._inflight.get(rid)
        if flight is None or _handed_over(msg, flight):
            self._remember(rid, msg.node_id)  # a new head: its decode rate counts from its own reports
            self.emit(self._handover(msg, flight) if _handed_over(msg, flight) else self.events.add(
                "connected", f"{msg.node_id} connected for {msg.model}", key=rid,
                node=msg.node_id, model=msg.model, hops=[hop_dict(h) for h in msg.route]))
        if msg.completion_tokens > 0 or msg.prefilled > 0:  # tokens come, or a long prompt prefills
            tps = self._decode_tps(msg) if msg.completion_tokens > 0 else 0.0
            head = self.registry.get(msg.node_id)
            self.emit(self.events.upsert(
                "progress", rid, _progress_line(msg, tps),
                node=msg.node_id, model=msg.model, tokens=msg.completion_tokens,
                tps=round(tps, 3), queue=head.queued if head else 0, elapsed=msg.elapsed,
                prefilled=msg.prefilled, prefill_tokens=msg.prefill_tokens, **_drafts(msg)))
        return Ack()

    def _handover(self, msg: Report, flight: _Flight | None) -> dict:
        """The event of a head that took the request over from one that died."""
        before = f" from {flight.node}" if flight is not None else ""
        return self.events.add(
            "handover", f"{msg.node_id} took over a request for {msg.model}{before} after {msg.resumed} tokens",
            key=msg.request_id, node=msg.node_id, model=msg.model, previous=flight.node if flight else None,
            resumed=msg.resumed, hops=[hop_dict(h) for h in msg.route])

    def _decode_tps(self, msg: Report) -> float:
        """Decode tokens per second since the request's first report with tokens."""
        flight = self._inflight[msg.request_id]
        if flight.first is None:
            flight.first = (msg.completion_tokens, msg.elapsed)
        timing = decode_timing(msg.completion_tokens, msg.elapsed, flight.first)
        return 1.0 / timing.seconds_per_token if timing else 0.0

    def _on_completion(self, msg: Report, ledger: Ledger, sender: str = "") -> Message:
        flight = self._inflight.pop(msg.request_id, None)
        entry, new = ledger.record(msg)
        if not new:
            return Ack(detail=f"already recorded: {entry.status}", request_id=msg.billing_id)
        if _handed_over(msg, flight):  # the new head ended it before its first progress report
            self.emit(self._handover(msg, flight))
            flight = None  # the first progress was another head's
        self._record_stats(msg, flight.first if flight else None, sender)
        self.speculation.record(msg)
        kind = "error" if msg.finish_reason == "error" else "complete"
        billing = entry.status + (f" ({entry.reason})" if entry.reason else "")
        self.emit(self.events.add(
            kind, f"{msg.model}: {msg.prompt_tokens} in / {msg.completion_tokens} out in "
            f"{msg.elapsed:.2f}s, {msg.finish_reason}, {billing}{_drafts_line(msg)}", key=msg.request_id,
            node=msg.node_id, model=msg.model, prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens, duration=msg.elapsed,
            finish_reason=msg.finish_reason, billing=entry.status, billing_reason=entry.reason,
            hops=[hop_dict(h) for h in msg.route], **_drafts(msg)))
        return Ack(detail=billing, request_id=msg.billing_id)

    def _record_stats(self, msg: Report, first: tuple[int, float] | None, sender: str = "") -> None:
        """Learn from the completion; after a handover, from the tokens of the last head only
        (its ``elapsed`` counts from when it took over). Only from a route this tracker can
        vouch for (``untrusted``); one vote per reporter: its key where there are keys (one
        key may register many node ids), else the head's node id."""
        nodes = {n.node_id: n for n in self.registry.snapshot(everyone=True)}
        why = untrusted(msg, nodes)
        if why:
            log.info("statistics ignore request %s from %s: %s", msg.request_id[:64], msg.node_id[:64], why)
            self.stats.refuse()
            return
        rates, cost = self.stats.layer_rates(), self.cost
        first = (first[0] - msg.resumed, first[1]) if first else None
        self.stats.record(
            Completion(model=msg.model, route=msg.route, completion_tokens=msg.completion_tokens - msg.resumed,
                       elapsed=msg.elapsed, finish_reason=msg.finish_reason, first_progress=first),
            hop_weights=hop_weights(msg.route, nodes, rates, cost),
            link_s=route_link_seconds(msg.route, nodes, cost),
            predicted_s=estimate_route(msg.route, nodes, rates, cost),
            min_compute_share=0.1 if links_measured(msg.route, nodes) else 0.5,
            head=sender or msg.node_id)


def untrusted(msg: Report, nodes: dict[str, NodeInfo]) -> str:
    """Why a completion's figures must not feed statistics; "" when they may.

    The head must be a registered node serving the model (in a secured swarm the service
    has checked that its node id belongs to the sender's key), and the route one the
    planner could have given: every hop a registered node of the model, all with one
    fingerprint, each inside its node's shard, together covering every layer. Otherwise
    any head could create rows for nodes that never served it and steer the plans."""
    head = nodes.get(msg.node_id)
    if head is None or head.model != msg.model:
        return f"the head is not a registered node serving {msg.model!r}"
    if not msg.route:
        return "no route"
    first = nodes.get(msg.route[0].node)
    for hop in msg.route:
        node = nodes.get(hop.node)
        if node is None or node.model != msg.model:
            return f"hop {hop.node[:64]!r} is not a registered node serving {msg.model!r}"
        if (node.fingerprint, node.num_layers) != (first.fingerprint, first.num_layers):
            return "the route's nodes hold different weights"
        if not node.start_layer <= hop.start_layer <= hop.end_layer <= node.end_layer:
            return f"hop {hop.node[:64]!r} does not hold layers {hop.start_layer}-{hop.end_layer}"
    if msg.route[-1].end_layer != first.num_layers - 1:
        return f"the route ends at layer {msg.route[-1].end_layer}, not {first.num_layers - 1}"
    return ""
