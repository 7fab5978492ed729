"""What the tracker shows: rows of nodes, plans and usage for ``meshnet status``, the
dashboard and the PUB feed, built from snapshots (no sockets, no state of their own)."""
from __future__ import annotations

from .ledger import Ledger
from .node_records import NodeInfo
from .planner import CostModel, Plan, hop_dict, layer_rate
from .registry import Registry
from .stats import StatsStore


def plans_view(plans: dict[str, Plan], nodes: list[NodeInfo], stats: StatsStore) -> dict:
    """Plans, gaps and, where nodes of one model hold different weights, those groups."""
    relays = {n.node_id: n.relay for n in nodes if n.relay}
    return {"plans": {m: [plan_row(m, r, relays, stats) for r in p.routes] for m, p in plans.items()},
            "gaps": {m: [list(g) for g in p.gaps] for m, p in plans.items() if p.gaps},
            "weights_differ": {m: [g.to_dict() for g in p.differ] for m, p in plans.items() if p.differ}}


def plan_row(model: str, route, relays: dict[str, str], stats: StatsStore) -> dict:
    """A planned route with its relayed hops marked, and the tokens/s requests on it
    actually got (``actual_tps`` None until one fed the statistics)."""
    row = route.to_dict()
    row["hops"] = [hop_dict(h, relays.get(h.node, "")) for h in route.hops]
    observed = stats.route_row(model, route.hops)
    row["actual_tps"] = observed["actual_tps"] if observed else None
    row["samples"] = observed["samples"] if observed else 0
    return row


def node_rows(registry: Registry, stats: StatsStore, cost: CostModel) -> list[dict]:
    rates = stats.layer_rates()
    return [node_row(n, rates, cost, registry.age(n), registry.excluded.get(n.node_id, ""))
            for n in registry.snapshot(everyone=True)]


def node_row(node: NodeInfo, rates: dict, cost: CostModel, age_s: float, excluded: str = "") -> dict:
    measured = rates.get((node.node_id, node.model))
    return {"id": node.node_id, "endpoint": node.endpoint, "model": node.model,
            "fingerprint": node.fingerprint, "layers": [node.start_layer, node.end_layer],
            "num_layers": node.num_layers, "sessions": node.sessions, "queued": node.queued,
            "max_sessions": node.max_sessions, "benchmark": node.benchmark,
            "layer_steps_per_s": layer_rate(node, rates, cost),
            "measured": measured is not None, "hardware": node.hardware,
            "last_seen_s": round(age_s, 3),
            "relay": node.relay, "relayed": bool(node.relay), "rtts": node.rtts, "reachable": node.reachable,
            "kv_cache": {"bytes": node.kv_bytes, "hits": node.kv_hits, "misses": node.kv_misses},
            "excluded": excluded,  # why an audit left it out of plans; "": it is planned
            **({"key": node.public_key} if node.public_key else {})}  # peers dial it with this (secured swarms)


def usage(ledger: Ledger | None) -> dict:
    if ledger is None:
        return {}
    return {"totals": ledger.totals(), "by_key": ledger.usage_by_key(), "by_node": ledger.usage_by_node()}
