"""What a node says about itself: its registration and heartbeats for the tracker, and its
rows for /metrics. Read-only views of the node's parts; ``metrics`` is safe to call from
another thread (counters are copied, every key exists from the start)."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from ..metrics import Sample
from ..wire import protocol as p

if TYPE_CHECKING:
    from .node import Node

# hops, cache misses, failovers, errors: for /metrics and tests
COUNTERS = ("hop_seconds", "hops", "batched_hops", "prefill_chunks", "riding_chunks", "cache_miss", "failovers",
            "rejected_frames", "dropped_frames", "hop_errors", "audits", "audits_passed", "audits_convicted",
            "audits_unsettled", "audits_skipped", "audit_taps", "audit_replays", "audit_frames_ignored")

# the loop's: hops that waited for the compute lock (another node of the machine computed), links to peers
# refused (too many open, none unneeded) and closed (idle, or making room)
COUNTERS += ("lock_waits", "refused_peers", "closed_peers")


def registration(node: Node) -> p.Register:
    c, w = node.config, node.executor.w
    relay = node.links.relay
    return p.Register(
        node_id=c.node_id, endpoint=node.endpoint, model=c.source.model_id, fingerprint=node.fingerprint,
        num_layers=c.shard.num_layers, start_layer=c.shard.start, end_layer=c.shard.end,
        hardware={"device": c.device, "dtype": str(w.dtype).removeprefix("torch."), "quant": c.quant or "none",
                  "threads": torch.get_num_threads(), "shard_bytes": w.parameter_bytes(),
                  "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        benchmark=node.benchmark, max_sessions=c.max_sessions, relay=relay.relay if relay else "",
        relay_key=relay.front_key if relay else "")


def heartbeat(node: Node) -> p.Heartbeat:
    kept = node.kv.retained
    return p.Heartbeat(node.config.node_id, sessions=len(node.kv), queued=len(node.scheduler),
                       rtts=node.peers.rtt.snapshot(time.monotonic()), kv_bytes=kept.bytes,
                       kv_hits=kept.stats["hits"], kv_misses=kept.stats["misses"])


def metrics(node: Node) -> list[Sample]:
    c, labels = node.counters.copy(), {"node": node.config.node_id}
    rows = [Sample("node_sessions", "sessions holding KV on this node", len(node.kv), labels=labels),
            Sample("node_kv_bytes", "bytes of KV cache held", node.kv.nbytes(), labels=labels),
            Sample("node_requests_in_flight", "requests this node heads", len(node.head or ()), labels=labels),
            Sample("node_queued_hops", "hops waiting to run", len(node.scheduler), labels=labels),
            Sample("node_hop_seconds_total", "seconds spent running hops", c["hop_seconds"], "counter", labels)]
    for name in COUNTERS[1:]:
        rows.append(Sample(f"node_{name}_total", f"{name.replace('_', ' ')} on this node", c[name],
                           "counter", labels))
    return rows + _kv_reuse_metrics(node, labels)


def _kv_reuse_metrics(node: Node, labels: dict) -> list[Sample]:
    kept = node.kv.retained
    stats = kept.stats.copy()
    return [Sample("node_kv_kept_bytes", "bytes of ended sessions' KV kept for reuse", kept.bytes, labels=labels),
            Sample("node_kv_kept_budget_bytes", "most bytes of KV kept for reuse", kept.budget, labels=labels),
            Sample("node_kv_kept_sessions", "ended sessions whose KV is kept", len(kept), labels=labels),
            Sample("node_kv_reuse_hits_total", "requests that started from kept KV", stats["hits"], "counter",
                   labels),
            Sample("node_kv_reuse_misses_total", "requests that asked for kept KV no longer here",
                   stats["misses"], "counter", labels),
            Sample("node_kv_reused_tokens_total", "prompt positions taken from kept KV instead of computed",
                   stats["reused_tokens"], "counter", labels),
            Sample("node_kv_evictions_total", "kept KV dropped to stay within the budget", stats["evictions"],
                   "counter", labels)]
