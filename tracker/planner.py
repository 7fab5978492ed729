"""Route planning: a pure function from a registry snapshot to ranked routes.

A route is a tuple of ``fabric.wire.protocol.Hop`` covering layers ``0..L-1`` contiguously.
Each hop starts at the previous hop's ``end_layer + 1`` -- never at the downstream node's
own shard start: a full node used as a tail after a partial head runs from the head's
end + 1, not from layer 0. Run from 0, it would put hidden states that already passed the
head's layers through those layers again and sample garbage, typically an end-of-sequence
token at once.

Cost model, per generated token::

    seconds = sum over hops of  layers * per_layer_s(node) * (1 + slowdown * sessions)
                              + queue_penalty_s * queued(node)
            + sum over hand-offs (a -> b) of  link(a, b)

where ``per_layer_s`` comes from measured layer-steps/s for (node, model) when the
stats store has it, else from the node's start-up benchmark. A pipeline hands off once
per hop and token: each hop to the next, and the tail back to the head with the token; a
single node hands off nothing. ``link(a, b)`` is half the round trip measured between a
and b (either node's report in its heartbeats), else the median of the links measured in
the swarm (``with_measured_links``; ``link_cost_s`` while none is), plus
``relay_penalty_s`` when b is reached through a relay (one more network traversal, and
one more process that copies every frame).

The search is a shortest path over layer boundaries (a DAG). A hop of node n ends either
at n's own end + 1 or where another node's shard starts: with a cost linear in the number
of layers, moving the switch point between two consecutive nodes towards the nearer of
those limits never makes the route slower (checked against brute force in the tests).
That holds while every hand-off costs the same; once round trips are measured the node
sequence matters (a one-layer hop through a well-linked node can beat a slow direct
link), so then every layer is a possible switch point.
Each boundary keeps the few cheapest partial routes ("labels"), one per node sequence,
with the set of nodes they used, so a node appears at most once per route and several
ranked routes, through different nodes, come out.

Scale: a hop's cost is linear in its start for a fixed end, so each node keeps only its
few best ways to start a hop (``_Open``) instead of one label per (start, end) pair; a
boundary then looks at holders x keep candidates. In a large swarm only the
``MAX_NODES_PER_LAYER`` fastest holders of each layer are searched (``_candidates``).
Together: O(layers x holders x keep), about 30 ms per route on one core at 1,000 nodes x
200 layers with round trips measured (``bench/swarm_scale.py``), where the search over
every (start, node, end) took seconds.
"""
from __future__ import annotations

import heapq
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from fabric.wire.protocol import Hop

from .node_records import NodeInfo

Throughput = Mapping[tuple[str, str], float]  # (node_id, model) -> measured layer-steps/s


@dataclass(frozen=True)
class CostModel:
    """Knobs of the per-token cost estimate; defaults suit a LAN of similar machines."""

    # one hidden-state hand-off between two nodes whose round trip is unknown, while no link of
    # the swarm is measured; once some are, their median (``with_measured_links``)
    link_cost_s: float = 0.002
    relay_penalty_s: float = 0.002  # added to a hand-off to a node reached through a relay
    queue_penalty_s: float = 0.05  # added per token for each request queued at a node
    session_slowdown: float = 0.25  # each active session adds this share to a hop's compute
    default_benchmark: float = 100.0  # layer-steps/s assumed when a node reported none
    pipeline_margin: float = 0.05  # a pipeline must be this much faster to outrank one node


@dataclass(frozen=True)
class PlannedRoute:
    """One candidate route and its estimated per-token time."""

    hops: tuple[Hop, ...]
    seconds_per_token: float
    fingerprint: str
    num_layers: int

    @property
    def estimated_tps(self) -> float:
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "hops": [hop_dict(h) for h in self.hops],
            "estimated_tps": round(self.estimated_tps, 3),
            "seconds_per_token": self.seconds_per_token,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class WeightGroup:
    """Nodes of one model id that hold the same weights (fingerprint and layer count)."""

    fingerprint: str
    num_layers: int
    nodes: tuple[tuple[str, int, int], ...]  # (node_id, start_layer, end_layer)

    @property
    def label(self) -> str:
        """The fingerprint's first 8 digits and its quantization, e.g. ``370161de:int8``."""
        digest, _, quant = self.fingerprint.partition(":")
        return digest[:8] + (f":{quant}" if quant else "")

    def describe(self) -> str:
        held = ", ".join(f"{n} [{_span(a, b)}]" for n, a, b in self.nodes)
        return f"{held} (fingerprint {self.label}, {self.num_layers} layers)"

    def to_dict(self) -> dict:
        return {"fingerprint": self.fingerprint, "label": self.label, "num_layers": self.num_layers,
                "nodes": [{"id": n, "layers": [a, b]} for n, a, b in self.nodes]}


@dataclass(frozen=True)
class Plan:
    """Ranked routes for one model; ``gaps``, ``skipped`` and ``differ`` explain an empty plan."""

    model: str
    routes: tuple[PlannedRoute, ...]
    gaps: tuple[tuple[int, int], ...] = ()  # inclusive layer ranges no usable node serves
    skipped: tuple[tuple[str, str], ...] = ()  # (node_id, why it was not considered)
    differ: tuple[WeightGroup, ...] = ()  # two or more: nodes claiming this model hold different weights

    @property
    def best(self) -> PlannedRoute | None:
        return self.routes[0] if self.routes else None

    def describe_differ(self) -> str:
        """"weights differ: ..." when nodes claiming this model never chain; else ""."""
        if len(self.differ) < 2:
            return ""
        return (f"weights differ: {' vs '.join(g.describe() for g in self.differ)}; nodes of {self.model!r} "
                f"chain only when they load the same file with the same --quant")

    def describe_missing(self) -> str:
        """A one-line reason for an empty plan, for NO_ROUTE errors."""
        parts = [f"no route for {self.model!r}"]
        if self.gaps:
            parts.append("layers " + ", ".join(_span(a, b) for a, b in self.gaps) + " are not served")
        reasons = [self.describe_differ()] if self.differ else []
        if self.skipped:
            reasons.append("skipped " + ", ".join(f"{n} ({why})" for n, why in self.skipped))
        return ": ".join(parts) + "".join("; " + r for r in reasons)


def _span(a: int, b: int) -> str:
    return f"{a}" if a == b else f"{a}-{b}"


def hop_dict(hop: Hop, relay: str = "") -> dict:
    row = {"node": hop.node, "endpoint": hop.endpoint, "start_layer": hop.start_layer, "end_layer": hop.end_layer}
    if relay:  # the endpoint is a relay's front
        row["relay"] = relay
    return {**row, "key": hop.key} if hop.key else row  # keys only in a secured swarm


# --------------------------------------------------------------------------- costs


def layer_rate(node: NodeInfo, throughput: Throughput, cost: CostModel) -> float:
    """Layer-steps/s for ``node``: measured if known, else benchmark, else the default."""
    measured = throughput.get((node.node_id, node.model), 0.0)
    if measured > 0:
        return measured
    return node.benchmark if node.benchmark > 0 else cost.default_benchmark


def hop_compute_seconds(node: NodeInfo, layers: int, throughput: Throughput,
                        cost: CostModel) -> float:
    """Per-token compute of ``layers`` layers on ``node`` under its current load."""
    base = layers / layer_rate(node, throughput, cost)
    return base * (1.0 + cost.session_slowdown * node.sessions) + cost.queue_penalty_s * node.queued


def rtt_ms(a: NodeInfo, b: NodeInfo) -> float | None:
    """The round trip between two nodes as either one measured it (ms); None if unknown."""
    ms = a.rtts.get(b.node_id) or b.rtts.get(a.node_id)
    return ms if ms and ms > 0 else None


def with_measured_links(nodes: Iterable[NodeInfo], cost: CostModel) -> CostModel:
    """``cost``, a hand-off over an unmeasured link priced as the median of the measured ones
    among ``nodes`` (half the round trip; ``link_cost_s`` while none is measured). An
    unmeasured link is as likely slow as fast: priced at a small default, a route through a
    link nobody measured yet would outrank a measured fast one only for being unmeasured."""
    ids = {n.node_id for n in nodes}
    measured = [ms for n in nodes for peer, ms in n.rtts.items() if peer in ids and ms > 0]
    return replace(cost, link_cost_s=statistics.median(measured) / 2000.0) if measured else cost


def link_between(src: NodeInfo, dst: NodeInfo, cost: CostModel) -> float:
    """Seconds of one hand-off from ``src`` to ``dst``: half the measured round trip, else
    ``cost.link_cost_s`` (see ``with_measured_links``); plus the relay penalty when ``dst`` is
    reached through a relay."""
    ms = rtt_ms(src, dst)
    one_way = ms / 2000.0 if ms is not None else cost.link_cost_s
    return one_way + (cost.relay_penalty_s if dst.relay else 0.0)


def route_link_seconds(hops: Sequence[Hop], nodes: Mapping[str, NodeInfo],
                       cost: CostModel = CostModel()) -> float:
    """Per-token network time of a route: each hop to the next, and the tail back to the
    head; none for a single node. Unmeasured links, and hops of unknown nodes, cost the
    median measured link (``with_measured_links``)."""
    if len(hops) < 2:
        return 0.0
    cost = with_measured_links(list(nodes.values()), cost)
    total = 0.0
    for a, b in zip(hops, [*hops[1:], hops[0]]):
        src, dst = nodes.get(a.node), nodes.get(b.node)
        total += link_between(src, dst, cost) if src and dst else cost.link_cost_s
    return total


def links_measured(hops: Sequence[Hop], nodes: Mapping[str, NodeInfo]) -> bool:
    """Whether every hand-off of a route has a measured round trip (a single node: none to measure)."""
    pairs = list(zip(hops, [*hops[1:], hops[0]])) if len(hops) > 1 else []
    return all(a.node in nodes and b.node in nodes and rtt_ms(nodes[a.node], nodes[b.node]) is not None
               for a, b in pairs)


def estimate_route(hops: Sequence[Hop], nodes: Mapping[str, NodeInfo],
                   throughput: Throughput | None = None,
                   cost: CostModel = CostModel()) -> float | None:
    """Per-token seconds of an explicit route, priced as ``plan_routes`` prices it; None if a
    hop's node is not known."""
    throughput = throughput or {}
    cost = with_measured_links(list(nodes.values()), cost)
    total = route_link_seconds(hops, nodes, cost)
    for hop in hops:
        node = nodes.get(hop.node)
        if node is None:
            return None
        total += hop_compute_seconds(node, hop.end_layer - hop.start_layer + 1, throughput, cost)
    return total


def hop_weights(hops: Sequence[Hop], nodes: Mapping[str, NodeInfo],
                throughput: Throughput | None = None,
                cost: CostModel = CostModel()) -> list[float] | None:
    """Predicted unloaded compute seconds per hop; None if a hop's node is not known."""
    throughput = throughput or {}
    if any(h.node not in nodes for h in hops):
        return None
    return [(h.end_layer - h.start_layer + 1) / layer_rate(nodes[h.node], throughput, cost)
            for h in hops]


# --------------------------------------------------------------------------- planning


def plan_routes(nodes: Iterable[NodeInfo], model: str, num_layers: int | None = None,
                exclude: Iterable[str] = (), max_routes: int = 3,
                throughput: Throughput | None = None, cost: CostModel = CostModel()) -> Plan:
    """Rank up to ``max_routes`` routes for ``model`` over the snapshot ``nodes``.

    Only nodes with the same model id, fingerprint and layer count share a route
    (``num_layers`` None: any layer count, planned per group). Excluded nodes and nodes
    at ``max_sessions`` are skipped. Links nobody measured cost the median of those measured
    in the whole snapshot (``with_measured_links``).
    """
    throughput = throughput or {}
    nodes = list(nodes)
    cost = with_measured_links(nodes, cost)
    usable, skipped = _usable(nodes, model, num_layers, frozenset(exclude))
    routes: list[PlannedRoute] = []
    for (fingerprint, layers), group in _groups(usable).items():
        routes.extend(_best_paths(group, layers, fingerprint, throughput, cost,
                                  keep=max_routes + 3))
    routes.sort(key=lambda r: _rank_key(r, cost))
    ranked = tuple(routes[:max_routes])
    gaps = () if ranked else _gaps_of_best_group(nodes, usable, model, num_layers)
    return Plan(model=model, routes=ranked, gaps=gaps, skipped=tuple(skipped), differ=weight_groups(nodes, model))


def weight_groups(nodes: Iterable[NodeInfo], model: str) -> tuple[WeightGroup, ...]:
    """The groups of nodes claiming ``model`` that hold different weights, largest first;
    () when they all agree (or serve nothing)."""
    groups = _groups(n for n in nodes if n.model == model)
    if len(groups) < 2:
        return ()
    found = [WeightGroup(fp, layers, tuple((n.node_id, n.start_layer, n.end_layer) for n in members))
             for (fp, layers), members in groups.items()]
    return tuple(sorted(found, key=lambda g: (-len(g.nodes), g.nodes)))


def plan_all(nodes: Sequence[NodeInfo], throughput: Throughput | None = None,
             max_routes: int = 3, cost: CostModel = CostModel()) -> dict[str, Plan]:
    """One plan per registered model id."""
    models = sorted({n.model for n in nodes})
    return {m: plan_routes(nodes, m, throughput=throughput, max_routes=max_routes, cost=cost)
            for m in models}


def _usable(nodes: Iterable[NodeInfo], model: str, num_layers: int | None,
            exclude: frozenset[str]) -> tuple[list[NodeInfo], list[tuple[str, str]]]:
    usable, skipped = [], []
    for node in nodes:
        if node.model != model:
            continue
        if node.node_id in exclude:
            skipped.append((node.node_id, "excluded"))
        elif node.at_capacity:
            skipped.append((node.node_id, f"at capacity {node.sessions}/{node.max_sessions}"))
        elif num_layers is not None and node.num_layers != num_layers:
            skipped.append((node.node_id, f"has {node.num_layers} layers, not {num_layers}"))
        else:
            usable.append(node)
    return usable, skipped


def _groups(nodes: Iterable[NodeInfo]) -> dict[tuple[str, int], list[NodeInfo]]:
    groups: dict[tuple[str, int], list[NodeInfo]] = defaultdict(list)
    for node in nodes:
        groups[(node.fingerprint, node.num_layers)].append(node)
    return groups


def _rank_key(route: PlannedRoute, cost: CostModel) -> tuple:
    handicap = 1.0 + cost.pipeline_margin if len(route.hops) > 1 else 1.0
    return (route.seconds_per_token * handicap, len(route.hops),
            tuple((h.node, h.start_layer) for h in route.hops))


def _boundaries(nodes: Sequence[NodeInfo], num_layers: int) -> list[int]:
    edges = {0, num_layers}
    for n in nodes:
        edges.update((n.start_layer, n.end_layer + 1))
    return sorted(b for b in edges if 0 <= b <= num_layers)


MAX_NODES_PER_LAYER = 16  # fastest holders of a layer the search considers there (see ``_candidates``)


@dataclass(frozen=True)
class _Label:
    """A partial route ending at a boundary: its cost, and how it got there (a parent chain,
    so extending a label copies nothing)."""

    seconds: float
    hops: int
    seq: tuple[str, ...]  # node ids in order: labels through the same nodes compete for one slot
    used: frozenset[str]
    node: NodeInfo | None  # the last hop's node (None: the empty route at layer 0)
    start: int  # the last hop's first layer
    end: int  # the boundary the label ends at (exclusive)
    parent: _Label | None
    order: tuple[int, int, int]  # (hop start, node index, parent's rank): the old insertion order breaks ties


def _route_hops(label: _Label) -> tuple[Hop, ...]:
    hops = []
    while label.parent is not None:
        node = label.node
        hops.append(Hop(node=node.node_id, endpoint=node.endpoint, start_layer=label.start,
                        end_layer=label.end - 1, key=node.public_key))
        label = label.parent
    return tuple(reversed(hops))


class _Open:
    """The best ways to start a hop of one node so far, one per node sequence before it:
    (cost at the node's last possible end, cost before the hop, hop start, frontier label,
    its rank). For a fixed end a hop's cost is linear in its start, so the order of these
    entries is the same at every end: the ``keep`` best of them are all a boundary needs."""

    __slots__ = ("node", "index", "slots", "worst", "rate", "load", "queue")

    def __init__(self, node: NodeInfo, index: int, throughput: Throughput, cost: CostModel):
        self.node, self.index = node, index
        self.slots: dict[tuple[str, ...], tuple[float, float, int, _Label, int]] = {}
        self.worst: tuple[float, int] | None = None  # (cost, start) of the entry the next better one replaces
        # hop_compute_seconds' terms, so that a hop's cost is computed as it computes it
        self.rate = layer_rate(node, throughput, cost)
        self.load = 1.0 + cost.session_slowdown * node.sessions
        self.queue = cost.queue_penalty_s * node.queued

    def seconds(self, layers: int) -> float:
        return layers / self.rate * self.load + self.queue

    def offer(self, entry: tuple[float, float, int, _Label, int], keep: int) -> None:
        seq = entry[3].seq
        held = self.slots.get(seq)
        if held is not None:
            if entry[0] < held[0]:
                self.slots[seq] = entry
                self.worst = None
        elif len(self.slots) < keep:
            self.slots[seq] = entry
            self.worst = None
        else:
            if self.worst is None:
                self.worst = max((e[0], e[2]) for e in self.slots.values())
            if entry[0] < self.worst[0]:
                del self.slots[next(k for k, e in self.slots.items() if (e[0], e[2]) == self.worst)]
                self.slots[seq] = entry
                self.worst = None


def _candidates(nodes: Sequence[NodeInfo], num_layers: int, throughput: Throughput,
                cost: CostModel) -> list[NodeInfo]:
    """The nodes among the ``MAX_NODES_PER_LAYER`` fastest holders of at least one of their
    layers (speed under load, queue spread over the shard), in snapshot order.

    In a large swarm most holders of a layer are slower than a dozen others there, and a
    route through them would need a link far better than every fast holder's to win; the
    search's cost grows with holders per layer, so it leaves them out. A swarm with at
    most that many holders per layer (every planner test) is planned exactly as before.
    """
    counts = [0] * num_layers

    def per_layer(i: int) -> tuple[float, int]:
        n = nodes[i]
        span = n.end_layer - n.start_layer + 1
        return (hop_compute_seconds(n, span, throughput, cost) / span, i)

    kept = []
    for i in sorted(range(len(nodes)), key=per_layer):
        n = nodes[i]
        if min(counts[n.start_layer:n.end_layer + 1]) < MAX_NODES_PER_LAYER:
            kept.append(i)
            for layer in range(n.start_layer, n.end_layer + 1):
                counts[layer] += 1
    return [nodes[i] for i in sorted(kept)]


def _best_paths(nodes: Sequence[NodeInfo], num_layers: int, fingerprint: str,
                throughput: Throughput, cost: CostModel, keep: int) -> list[PlannedRoute]:
    """k-best shortest paths from boundary 0 to ``num_layers`` with distinct nodes.

    Each boundary keeps the ``keep`` cheapest labels (one per node sequence); each node
    keeps the ``keep`` best ways to start a hop (``_Open``), so a boundary looks at
    holders x keep candidates, not at every (start, node, end): O(L * holders * keep).
    """
    # Measured links make the node sequence matter: a one-layer hop through a well-linked
    # node can beat a slow direct link, so every layer is a possible switch point then.
    nodes = _candidates(nodes, num_layers, throughput, cost)
    measured = any(n.rtts for n in nodes)
    bounds = list(range(num_layers + 1)) if measured else _boundaries(nodes, num_layers)
    starts = None if measured else {n.start_layer for n in nodes}  # None: a hop may end anywhere
    opened = [_Open(n, i, throughput, cost) for i, n in enumerate(nodes)]
    frontier = [_Label(0.0, 0, (), frozenset(), None, 0, 0, None, (0, 0, 0))]
    for b in bounds:
        if b == num_layers:
            return _settle(_arrivals(opened, b, starts, None), fingerprint, num_layers, cost, keep)
        if b > 0:
            frontier = _arrivals(opened, b, starts, keep)
        for slot in opened:
            if frontier and slot.node.start_layer <= b <= slot.node.end_layer:
                _open(slot, frontier, b, cost, keep)
    return []


def _open(slot: _Open, frontier: Sequence[_Label], b: int, cost: CostModel, keep: int) -> None:
    """Offer each frontier label at ``b`` as a start of a hop of ``slot.node``, paying the
    hand-off from the label's last hop (the first hop pays a default one for the token's
    return, settled in ``_settle``)."""
    node = slot.node
    full = slot.seconds(node.end_layer + 1 - b)
    for rank, label in enumerate(frontier):
        if node.node_id not in label.used:
            base = label.seconds + (link_between(label.node, node, cost) if label.node else cost.link_cost_s)
            slot.offer((base + full, base, b, label, rank), keep)


def _arrivals(opened: Sequence[_Open], e: int, starts: set[int] | None, keep: int | None) -> list[_Label]:
    """The labels whose last hop ends at boundary ``e`` (layers ..e-1), cheapest first (only
    the ``keep`` cheapest unless None): each node's open hops that may end there (at the
    node's own end, or -- unless links are measured -- where another node's shard starts).
    They all differ in their node sequence: a node holds one open hop per sequence before it."""
    found = []
    for slot in opened:
        node = slot.node
        if not slot.slots or not node.start_layer < e <= node.end_layer + 1:
            continue
        if starts is not None and e != node.end_layer + 1 and e not in starts:
            continue
        for _, base, b, label, rank in slot.slots.values():
            if b < e:
                found.append((base + slot.seconds(e - b), label.hops + 1, (b, slot.index, rank), slot, label))
    chosen = sorted(found, key=lambda x: x[:3]) if keep is None else heapq.nsmallest(keep, found, key=lambda x: x[:3])
    return [_Label(seconds, hops, label.seq + (slot.node.node_id,), label.used | {slot.node.node_id}, slot.node,
                   order[0], e, label, order) for seconds, hops, order, slot, label in chosen]


def _settle(finals: list[_Label], fingerprint: str, num_layers: int, cost: CostModel,
            keep: int) -> list[PlannedRoute]:
    """The ``keep`` cheapest complete routes. The first hop paid a default hand-off for the
    token's way back to the head; settle it now that the tail is known (a single node
    samples its own token: no hand-off). Every complete route is settled before the
    cheapest are chosen, so a route that only the way back makes cheap still ranks."""
    settled = []
    for label in finals:
        head = label
        while head.parent.parent is not None:
            head = head.parent
        back = link_between(label.node, head.node, cost) if head is not label else 0.0
        settled.append((label.seconds - cost.link_cost_s + back, label.hops, label.order, label))
    return [PlannedRoute(_route_hops(label), seconds, fingerprint, num_layers)
            for seconds, _, _, label in heapq.nsmallest(keep, settled, key=lambda x: x[:3])]


# --------------------------------------------------------------------------- coverage


def coverage_gaps(nodes: Iterable[NodeInfo], num_layers: int) -> tuple[tuple[int, int], ...]:
    """Inclusive layer ranges of 0..num_layers-1 that no node in ``nodes`` holds."""
    covered = [False] * num_layers
    for n in nodes:
        for layer in range(n.start_layer, min(n.end_layer, num_layers - 1) + 1):
            covered[layer] = True
    gaps, start = [], None
    for layer, held in enumerate(covered + [True]):
        if not held and start is None:
            start = layer
        elif held and start is not None:
            gaps.append((start, layer - 1))
            start = None
    return tuple(gaps)


def _gaps_of_best_group(all_nodes: Iterable[NodeInfo], usable: Sequence[NodeInfo], model: str,
                        num_layers: int | None) -> tuple[tuple[int, int], ...]:
    """Gaps of the (fingerprint, layer count) group that misses the fewest layers."""
    keys = {(n.fingerprint, n.num_layers) for n in all_nodes
            if n.model == model and (num_layers is None or n.num_layers == num_layers)}
    if not keys:
        return ((0, num_layers - 1),) if num_layers else ()
    groups = _groups(usable)
    candidates = [coverage_gaps(groups.get(k, ()), k[1]) for k in keys]
    return min(candidates, key=lambda gaps: (sum(b - a + 1 for a, b in gaps), gaps))


def assign_span(nodes: Iterable[NodeInfo], model: str, num_layers: int,
                max_layers: int = 0) -> tuple[int, int]:
    """The least-covered contiguous span of ``max_layers`` layers (0: all) for ``model``.

    Coverage counts registered nodes of the same model and layer count; ties go to the
    span whose busiest layer is least covered, then to the lowest start.
    """
    width = max_layers if 0 < max_layers < num_layers else num_layers
    counts = [0] * num_layers
    for n in nodes:
        if n.model == model and n.num_layers == num_layers:
            for layer in range(n.start_layer, n.end_layer + 1):
                counts[layer] += 1
    best = min(range(num_layers - width + 1),
               key=lambda s: (sum(counts[s:s + width]), max(counts[s:s + width]), s))
    return best, best + width - 1
