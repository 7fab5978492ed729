"""The routes a client remembers, so that it keeps serving while the tracker is away.

The tracker is never in the data path: a route, once known, works without it. A client
remembers the last route the tracker gave it for each model, and any plans it is shown
(the web UI feeds it every ``plans`` publication of the tracker's PUB, and each status
body). When the tracker does not answer, a request goes on a remembered route that avoids
the nodes the client saw die or leave since; a fresh answer from the tracker replaces what was
remembered, and forgets those deaths and leaves (the tracker knows better).
"""
from __future__ import annotations

import logging
from typing import Any

from ..wire import protocol as p

log = logging.getLogger(__name__)

MAX_ROUTES = 8  # routes remembered per model, best first


class RouteBook:
    def __init__(self) -> None:
        self._routes: dict[str, list[tuple[p.Hop, ...]]] = {}  # model -> routes, best first
        self.dead: set[str] = set()  # node ids seen dying since the tracker last spoke
        self.leaving: set[str] = set()  # node ids that refused a request as leaving, since then

    def __contains__(self, model: str) -> bool:
        return bool(self._routes.get(model))

    def __bool__(self) -> bool:
        """Whether any route is remembered."""
        return any(self._routes.values())

    def learn(self, model: str, route: tuple[p.Hop, ...]) -> None:
        """The tracker's answer: the best route now; its nodes are alive."""
        known = [r for r in self._routes.get(model, []) if r != route]
        self._routes[model] = [route, *known][:MAX_ROUTES]
        self.dead -= {h.node for h in route}
        self.leaving -= {h.node for h in route}

    def learn_plans(self, plans: Any) -> None:
        """A ``plans`` publication or a status body (``{"plans": {model: [{"hops": [...]}]}}``):
        every model's ranked routes replace what was remembered for it. Malformed rows are skipped."""
        by_model = plans.get("plans") if isinstance(plans, dict) else None
        if not isinstance(by_model, dict):
            return
        for model, rows in by_model.items():
            if not isinstance(rows, list):
                continue
            routes = [r for r in (_route(row) for row in rows if isinstance(row, dict)) if r]
            if routes:
                self._routes[model] = routes[:MAX_ROUTES]
            else:
                self._routes.pop(model, None)  # the tracker says nothing serves it now
        self.dead.clear()
        self.leaving.clear()

    def died(self, node: str) -> None:
        self.dead.add(node)

    def left(self, node: str) -> None:
        """``node`` is leaving the swarm: alive, but it takes no new request."""
        self.leaving.add(node)

    def instead(self, model: str, exclude: tuple[str, ...] = ()) -> tuple[p.Hop, ...] | None:
        """The best remembered route of ``model`` that uses none of ``exclude`` and no node
        seen dying or leaving; None when there is none."""
        avoid = self.dead | self.leaving | set(exclude)
        for route in self._routes.get(model, []):
            if not any(h.node in avoid for h in route):
                return route
        return None

    def models(self) -> list[dict]:
        """The remembered models, as ``models_of`` lists them (the tracker is away)."""
        rows = []
        for model, routes in sorted(self._routes.items()):
            nodes = {h.node for r in routes for h in r}
            rows.append({"id": model, "num_layers": routes[0][-1].end_layer + 1, "nodes": len(nodes),
                         "routable": self.instead(model) is not None})
        return rows


def _route(row: dict) -> tuple[p.Hop, ...] | None:
    try:
        hops = tuple(p.Hop(str(h["node"]), str(h["endpoint"]), int(h["start_layer"]), int(h["end_layer"]),
                           key=str(h.get("key", ""))) for h in row.get("hops", []))
    except (KeyError, TypeError, ValueError, AttributeError):
        log.debug("ignoring a malformed planned route: %r", row)
        return None
    return hops or None
