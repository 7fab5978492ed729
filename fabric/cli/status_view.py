"""``meshnet status`` as a reader sees it: the nodes, a coverage map per model, the plans,
recent events. Pure functions of the tracker's status dict."""
from __future__ import annotations


def format_status(status: dict) -> str:
    """A readable view: nodes, a coverage map per model, the plans, recent events."""
    nodes = status.get("nodes", [])
    lines = [f"{'NODE':<20} {'MODEL':<18} {'LAYERS':<9} {'SESSIONS':>8} {'LAYER-STEPS/S':>14} "
             f"{'KV KEPT (HITS/MISSES)':>22}  ENDPOINT"]
    for n in nodes:
        a, b = n["layers"]
        rate = n.get("layer_steps_per_s") or n.get("benchmark") or 0
        via = f" (relayed via {n['relay']})" if n.get("relay") else ""
        via += " EXCLUDED: an audit caught it returning wrong results" if n.get("excluded") else ""
        via += f" SENT BAD BYTES to {n['bad_bytes']} fetch(es) from peers" if n.get("bad_bytes") else ""
        lines.append(f"{n['id']:<20} {n['model']:<18} {f'{a}-{b}':<9} {n.get('sessions', 0):>8} {rate:>14.0f} "
                     f"{kv_cache_cell(n.get('kv_cache') or {}):>22}  {n['endpoint']}{via}")
    for model in sorted({n["model"] for n in nodes}):
        lines += ["", f"{model}:", *coverage_map(model, nodes)]
        plans = status.get("plans", {}).get(model) or []
        for rank, plan in enumerate(plans, 1):
            hops = " -> ".join(f"{h['node']}[{h['start_layer']}-{h['end_layer']}]"
                               + (" (relayed)" if h.get("relay") else "") for h in plan["hops"])
            actual = plan.get("actual_tps")
            seen = f", observed {actual:.1f} over {plan.get('samples', 0)} requests" if actual else ""
            lines.append(f"  plan {rank}: {hops}  (~{plan.get('estimated_tps', 0):.1f} tok/s{seen})")
        if not plans:
            gaps = status.get("gaps", {}).get(model)
            lines.append(f"  no complete route{f' (missing layers {gaps})' if gaps else ''}")
        lines += weights_differ_lines(status.get("weights_differ", {}).get(model) or [])
        lines += [fetch_line(f) for f in status.get("fetches", []) if f.get("model") == model]
        lines += speculation_lines(status.get("speculation", {}).get(model) or [])
    events = status.get("events", [])[-8:]
    if events:
        lines += ["", "recent events:"]
        lines += [f"  {e.get('kind', ''):<15} {e.get('message', '')}" for e in events]
    return "\n".join(lines)


def fetch_line(f: dict) -> str:
    """A fetch of layers from peers: ``  b fetching layers 3-5: 1.2 of 4.0 MiB (30%), 2.0 MiB/s; bad bytes from c``."""
    def mib(n: int) -> str:
        return f"{n / (1 << 20):,.1f}"
    a, b = f["layers"]
    state = f.get("state")
    if state == "fetching":
        pct = 100 * f["done"] // f["total"] if f.get("total") else 0
        doing = f"fetching layers {a}-{b}: {mib(f['done'])} of {mib(f['total'])} MiB ({pct}%), {mib(f['rate'])} MiB/s"
    else:
        doing = f"fetched layers {a}-{b}: {mib(f['total'])} MiB" if state == "done" else \
            f"fetch of layers {a}-{b} failed: {f.get('error', '')}"
    bad = f"; bad bytes from {', '.join(f['bad_peers'])} (left out)" if f.get("bad_peers") else ""
    return f"  {f.get('node') or 'meshnet pull'} {doing}{bad}"


def kv_cache_cell(kv: dict) -> str:
    """A node's kept KV and how often requests found it there: ``46.1 MiB (4/1)``."""
    return f"{kv.get('bytes', 0) / (1 << 20):.1f} MiB ({kv.get('hits', 0)}/{kv.get('misses', 0)})"


def weights_differ_lines(groups: list[dict]) -> list[str]:
    """Nodes that claim one model with different weights: they never share a route."""
    if len(groups) < 2:
        return []
    lines = ["  weights differ: these nodes claim this model but hold different weights, so they never chain:"]
    for g in groups:
        held = ", ".join(f"{n['id']} [{n['layers'][0]}-{n['layers'][1]}]" for n in g["nodes"])
        lines.append(f"    fingerprint {g['label']} ({g['num_layers']} layers): {held}")
    lines.append("    load the same model file on every node, with the same --quant")
    return lines


def coverage_map(model: str, nodes: list[dict], width: int = 60) -> list[str]:
    """One bar per node over the model's layer axis, e.g. ``node-a  |#####.....|  0-14``."""
    mine = [n for n in nodes if n["model"] == model]
    total = max((n.get("num_layers") or n["layers"][1] + 1) for n in mine)
    scale = min(width, total) / total
    rows = []
    for n in sorted(mine, key=lambda n: n["layers"]):
        a, b = n["layers"]
        lo, hi = int(a * scale), max(int(a * scale) + 1, int((b + 1) * scale))
        bar = "." * lo + "#" * (hi - lo) + "." * (int(total * scale) - hi)
        rows.append(f"  {n['id']:<20} |{bar}| {a}-{b} of {total}")
    return rows


def speculation_lines(routes: list[dict]) -> list[str]:
    """Per route that drafted: ``speculation a -> b: 12 requests, 61% of drafts kept, 2.40 tokens a trip``."""
    return [f"  speculation {' -> '.join(r['route'])}: {r['requests']} requests, "
            f"{r['acceptance'] or 0:.0%} of drafts kept, {r['tokens_per_trip'] or 1:.2f} tokens a trip"
            for r in routes]
