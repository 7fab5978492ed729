"""Prometheus metrics for every meshnet process, read from live state at scrape time.

Each process hands a ``sample`` function returning ``Sample`` rows; one collector turns
them into metric families, so a scrape never races the process's own bookkeeping.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Sample:
    name: str  # without the meshnet_ prefix
    help: str
    value: float
    kind: str = "gauge"  # or "counter"
    labels: dict = field(default_factory=dict)


class _Collector:
    def __init__(self, sample: Callable[[], Iterable[Sample]]):
        self.sample = sample

    def collect(self):
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for s in self.sample():
            family = families.get(s.name)
            if family is None:
                cls = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
                family = families[s.name] = cls(f"meshnet_{s.name}", s.help, labels=sorted(s.labels))
            family.add_metric([str(s.labels[k]) for k in sorted(s.labels)], s.value)
        return list(families.values())


def speculation_samples(view: dict[str, list[dict]], prefix: str, extra: dict | None = None) -> list[Sample]:
    """/metrics rows for a ``RouteSpeculation.view()`` (fabric/wire/route_drafts.py), named
    ``{prefix}_route_spec_*``: per (model, route), the counters, and acceptance and tokens per
    trip as gauges; ``extra`` labels on each (a node's id)."""
    rows = []
    for model, routes in view.items():
        for r in routes:
            labels = {**(extra or {}), "model": model, "route": ">".join(r["route"])}
            rows += [Sample(f"{prefix}_route_spec_{name}_total", f"{what} of requests on the route that drafted",
                            r[name], "counter", labels)
                     for name, what in (("trips", "decode trips"), ("drafted", "drafts sent"), ("kept", "drafts kept"))]
            rows += [Sample(f"{prefix}_route_spec_acceptance", "share of drafts the tail kept", r["acceptance"] or 0.0,
                            labels=labels),
                     Sample(f"{prefix}_route_spec_tokens_per_trip", "tokens one trip through the route yielded",
                            r["tokens_per_trip"] or 0.0, labels=labels)]
    return rows


def registry_for(sample: Callable[[], Iterable[Sample]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(sample))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of ``registry`` (for an HTTP handler of one's own)."""
    return generate_latest(registry)


def serve(port: int, sample: Callable[[], Iterable[Sample]], host: str = "127.0.0.1"):
    """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns (server, thread)."""
    server, thread = start_http_server(port, addr=host, registry=registry_for(sample))
    log.info("metrics at http://%s:%d/metrics", host, port)
    return server, thread
