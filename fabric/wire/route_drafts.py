"""Speculation per route, from completion reports: how many trips through the route the
requests took, the drafts they carried and those the tail kept. Pure, bounded.

A head adds up its own requests (a node's /metrics); the tracker sees every head's, so it is
where a route's figures add up for the swarm: the share of drafts kept (acceptance) and the
tokens one trip through the hops yielded (1 for a plain step, up to 1 + drafts for a
verification). ``meshnet status``, the dashboard's swarm view and the tracker's /metrics show them.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .protocol import Report

MAX_ROUTES = 256  # routes remembered; the one least recently reported goes first


@dataclass
class RouteDrafts:
    """What the requests of one route added up to."""

    requests: int = 0  # requests that drafted at least once
    trips: int = 0  # their decode steps (trips through the route)
    drafted: int = 0
    kept: int = 0

    def view(self) -> dict:
        return {"requests": self.requests, "trips": self.trips, "drafted": self.drafted, "kept": self.kept,
                **rates(self.trips, self.drafted, self.kept)}


def rates(trips: int, drafted: int, kept: int) -> dict:
    """``acceptance`` (share of drafts kept) and ``tokens_per_trip``, rounded; None where nothing counts."""
    return {"acceptance": round(kept / drafted, 4) if drafted else None,
            "tokens_per_trip": round((trips + kept) / trips, 4) if trips else None}


def route_key(report: Report) -> tuple[str, str]:
    """(model, "node>node>..."): a route by the nodes it chains."""
    return report.model, ">".join(h.node for h in report.route)


class RouteSpeculation:
    """Completion reports in, per-route figures out; at most MAX_ROUTES routes."""

    def __init__(self, max_routes: int = MAX_ROUTES):
        self.max_routes = max_routes
        self._routes: OrderedDict[tuple[str, str], RouteDrafts] = OrderedDict()

    def record(self, report: Report) -> None:
        """Add a final report's counts (one that drafted nothing adds nothing)."""
        if not report.trips or not report.route:
            return
        key = route_key(report)
        row = self._routes.pop(key, None) or RouteDrafts()
        row.requests += 1
        row.trips += report.trips
        row.drafted += report.drafted
        row.kept += report.kept
        self._routes[key] = row
        while len(self._routes) > self.max_routes:
            self._routes.popitem(last=False)

    def view(self) -> dict[str, list[dict]]:
        """{model: [{"route": [node, ...], "requests", "trips", "drafted", "kept", "acceptance",
        "tokens_per_trip"}, ...]}, most recently reported first."""
        out: dict[str, list[dict]] = {}
        # a copy first (one C call): a node's /metrics thread reads this while its loop records
        for (model, route), row in reversed(list(self._routes.items())):
            out.setdefault(model, []).append({"route": route.split(">"), **row.view()})
        return out
