"""What a node says about itself: its registration and heartbeats for the tracker, and its
rows for /metrics. Pure functions of snapshots the node takes (``Identity``, ``Load``), so this
module never sees the node itself: the node imports it, not the other way round. ``Load`` holds
copies, so ``metrics`` is safe to call from another thread (every counter exists from the start)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..metrics import Sample, speculation_samples
from ..wire import protocol as p
from .config import NodeConfig

# hops, cache misses, failovers, errors: for /metrics and tests
COUNTERS = ("hop_seconds", "hops", "batched_hops", "prefill_chunks", "riding_chunks", "cache_miss", "failovers",
            "rejected_frames", "dropped_frames", "hop_errors", "audits", "audits_passed", "audits_convicted",
            "audits_unsettled", "audits_skipped", "audit_taps", "audit_replays", "audit_frames_ignored")

# the loop's: hops that waited for the compute lock (another node of the machine computed), links to peers
# refused (too many open, none unneeded) and closed (idle, or making room)
COUNTERS += ("lock_waits", "refused_peers", "closed_peers")

# speculation: verification steps of ended requests this node headed, their drafts sent and kept; and drafted
# positions this hop cut off sessions' KV after the tail rejected them
COUNTERS += ("spec_trips", "spec_drafted", "spec_kept", "rolled_back")

# pipelined speculation: steps this node headed that were sent ahead of the step before them, those the
# tail ran (every draft before them kept, and their guess right), and at the tail, those it found void
COUNTERS += ("spec_ahead", "spec_ahead_held", "void_steps")


@dataclass(frozen=True)
class Identity:
    """What the node registers as: fixed once its weights load, but for the relay it is reached through."""
    config: NodeConfig
    endpoint: str  # where peers dial it (a relay's front when relayed)
    fingerprint: str  # of its weights: nodes with different ones never chain
    benchmark: float  # layer-steps per second measured at start
    dtype: torch.dtype  # of its weights as loaded
    shard_bytes: int  # bytes of its layers' parameters
    relay: str = ""  # the relay's control endpoint when relayed, else ""
    relay_key: str = ""  # the relay front's public key when relayed and secured, else ""


@dataclass(frozen=True)
class Load:
    """How busy the node is at one moment; every field a copy."""
    node_id: str
    sessions: int  # sessions holding KV here
    kv_bytes: int  # bytes of their KV
    heads: int  # requests this node heads
    queued: int  # hops waiting to run
    counters: Mapping[str, float]  # COUNTERS, each present
    kept_bytes: int  # bytes of ended sessions' KV kept for reuse
    kept_budget: int  # most bytes of KV kept
    kept_sessions: int  # ended sessions whose KV is kept
    kept_stats: Mapping[str, int]  # hits, misses, reused_tokens, evictions
    routes: Mapping[str, list] = field(default_factory=dict)  # speculation per route of requests it headed (a view)


def registration(me: Identity) -> p.Register:
    c = me.config
    return p.Register(
        node_id=c.node_id, endpoint=me.endpoint, model=c.source.model_id, fingerprint=me.fingerprint,
        num_layers=c.shard.num_layers, start_layer=c.shard.start, end_layer=c.shard.end,
        hardware={"device": c.device, "dtype": str(me.dtype).removeprefix("torch."), "quant": c.quant or "none",
                  "threads": torch.get_num_threads(), "shard_bytes": me.shard_bytes,
                  "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        benchmark=me.benchmark, max_sessions=c.max_sessions, relay=me.relay, relay_key=me.relay_key)


def heartbeat(load: Load, rtts: dict) -> p.Heartbeat:
    """``rtts``: the round trips to peers the node measured, as ``RttTable.snapshot`` gives them."""
    return p.Heartbeat(load.node_id, sessions=load.sessions, queued=load.queued, rtts=rtts,
                       kv_bytes=load.kept_bytes, kv_hits=load.kept_stats["hits"],
                       kv_misses=load.kept_stats["misses"])


def metrics(load: Load) -> list[Sample]:
    c, labels = load.counters, {"node": load.node_id}
    rows = [Sample("node_sessions", "sessions holding KV on this node", load.sessions, labels=labels),
            Sample("node_kv_bytes", "bytes of KV cache held", load.kv_bytes, labels=labels),
            Sample("node_requests_in_flight", "requests this node heads", load.heads, labels=labels),
            Sample("node_queued_hops", "hops waiting to run", load.queued, labels=labels),
            Sample("node_hop_seconds_total", "seconds spent running hops", c["hop_seconds"], "counter", labels)]
    for name in COUNTERS[1:]:
        rows.append(Sample(f"node_{name}_total", f"{name.replace('_', ' ')} on this node", c[name],
                           "counter", labels))
    return rows + _kv_reuse_metrics(load, labels) + speculation_samples(load.routes, "node", labels)


def _kv_reuse_metrics(load: Load, labels: dict) -> list[Sample]:
    stats = load.kept_stats
    return [Sample("node_kv_kept_bytes", "bytes of ended sessions' KV kept for reuse", load.kept_bytes,
                   labels=labels),
            Sample("node_kv_kept_budget_bytes", "most bytes of KV kept for reuse", load.kept_budget, labels=labels),
            Sample("node_kv_kept_sessions", "ended sessions whose KV is kept", load.kept_sessions, labels=labels),
            Sample("node_kv_reuse_hits_total", "requests that started from kept KV", stats["hits"], "counter",
                   labels),
            Sample("node_kv_reuse_misses_total", "requests that asked for kept KV no longer here",
                   stats["misses"], "counter", labels),
            Sample("node_kv_reused_tokens_total", "prompt positions taken from kept KV instead of computed",
                   stats["reused_tokens"], "counter", labels),
            Sample("node_kv_evictions_total", "kept KV dropped to stay within the budget", stats["evictions"],
                   "counter", labels)]
