"""The dashboard's live state, derived from the tracker's events: pure, no sockets, no clock.

``CallBoard`` turns the tracker's console events into one row per request (the Call
wall): ``connected`` opens a row with its route (``handover`` moves it to the head that took
the request over from one that died), ``progress`` moves its prefill, tokens, tok/s and
queue, ``complete``/``error`` close it into the recent list with usage, duration and
billing. ``ThroughputMeter`` turns the same events into tokens per second served by each
node, sampled over time. Both accept the same event twice (from the PUB feed and from a
status poll) without counting it twice.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Any

RUNNING, COMPLETE, CANCELLED, ERROR, LOST = "running", "complete", "cancelled", "error", "lost"
OPEN_KINDS = ("connected", "handover", "progress")
FINAL_KINDS = ("complete", "error")
MAX_TRACKED = 4096  # request keys remembered (finished, or counted by the meter)


def _number(value: Any, default: float = 0) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _hops(value: Any) -> list[dict]:
    """The event's route as ``[{"node", "start_layer", "end_layer"}]``; junk is dropped."""
    if not isinstance(value, list):
        return []
    return [{"node": str(h.get("node", "?")), "start_layer": int(_number(h.get("start_layer"))),
             "end_layer": int(_number(h.get("end_layer")))} for h in value if isinstance(h, dict)]


def _final_state(event: dict) -> str:
    reason = event.get("finish_reason")
    if event.get("kind") == "error" or reason == "error":
        return ERROR
    return CANCELLED if reason == "cancelled" else COMPLETE


class CallBoard:
    """Requests in flight and recently finished, one row per request key."""

    def __init__(self, recent: int = 30, idle_timeout: float = 120.0):
        self.idle_timeout = idle_timeout  # seconds without an update before a row is "lost"
        self._active: OrderedDict[str, dict] = OrderedDict()
        self._seen: dict[str, float] = {}  # key -> when (caller's clock) its row last changed
        self._recent: deque[dict] = deque(maxlen=recent)
        self._finished: OrderedDict[str, None] = OrderedDict()

    def apply(self, event: dict, now: float) -> dict | None:
        """Fold one tracker event in, seen at ``now`` (the caller's clock, as ``expire``'s).

        The changed row (a copy), or None if nothing changed.
        """
        key, kind = event.get("key"), event.get("kind")
        if not isinstance(key, str) or kind not in OPEN_KINDS + FINAL_KINDS or key in self._finished:
            return None
        row = self._active.get(key)
        seq = _number(event.get("seq"))
        if row is not None and seq <= row["seq"]:
            return None  # already applied (a status poll repeats what the feed sent)
        row = row or self._open(key, event)
        row["seq"], row["updated"] = seq, _number(event.get("updated"), row["updated"])
        row["message"] = str(event.get("message", ""))
        self._seen[key] = now
        if event.get("hops"):
            row["hops"] = _hops(event["hops"])
        if kind == "handover":
            row["node"] = str(event.get("node", row["node"]))
        elif kind == "progress":
            row.update(tokens=int(_number(event.get("tokens"), row["tokens"])), tps=_number(event.get("tps")),
                       queue=int(_number(event.get("queue"))), elapsed=_number(event.get("elapsed")),
                       prefilled=int(_number(event.get("prefilled"))),
                       prefill_tokens=int(_number(event.get("prefill_tokens"))))
            _drafts(row, event)
        elif kind in FINAL_KINDS:
            _drafts(row, event)
            self._close(row, event, _final_state(event))
        return dict(row)

    def expire(self, now: float) -> list[dict]:
        """Close rows with no news for ``idle_timeout`` seconds (their head went away)."""
        stale = [row for row in self._active.values() if now - self._seen[row["key"]] > self.idle_timeout]
        for row in stale:
            self._close(row, {"finish_reason": None}, LOST)
            row["message"] = "no news from the head for a while"
        return [dict(row) for row in stale]

    def snapshot(self) -> dict:
        """``{"active": [rows, oldest first], "recent": [rows, newest first]}``."""
        return {"active": [dict(r) for r in self._active.values()],
                "recent": [dict(r) for r in reversed(self._recent)]}

    def _open(self, key: str, event: dict) -> dict:
        ts = _number(event.get("ts"))
        row = {"key": key, "state": RUNNING, "model": str(event.get("model", "")),
               "node": str(event.get("node", "")), "hops": [], "tokens": 0, "tps": 0.0, "queue": 0,
               "prefilled": 0, "prefill_tokens": 0, "trips": 0, "drafted": 0, "kept": 0,
               "acceptance": None, "tokens_per_trip": None,
               "elapsed": 0.0, "started": ts, "updated": ts, "seq": 0, "message": "",
               "prompt_tokens": None, "completion_tokens": None, "duration": None,
               "finish_reason": None, "billing": None, "billing_reason": None}
        self._active[key] = row
        return row

    def _close(self, row: dict, event: dict, state: str) -> None:
        row["state"] = state
        for name in ("prompt_tokens", "completion_tokens", "duration", "finish_reason",
                     "billing", "billing_reason"):
            if event.get(name) is not None:
                row[name] = event[name]
        if row["completion_tokens"] is not None:
            row["tokens"] = int(_number(row["completion_tokens"], row["tokens"]))
        self._active.pop(row["key"], None)
        self._seen.pop(row["key"], None)
        self._recent.append(row)
        self._finished[row["key"]] = None
        while len(self._finished) > MAX_TRACKED:
            self._finished.popitem(last=False)


def _drafts(row: dict, event: dict) -> None:
    """A request's speculation from its head's latest report: trips, drafts sent and kept, and
    the share kept and tokens per trip (None where it drafted nothing)."""
    if event.get("trips") is None:
        return  # a tracker that predates them
    row.update(trips=int(_number(event.get("trips"))), drafted=int(_number(event.get("drafted"))),
               kept=int(_number(event.get("kept"))))
    for name in ("acceptance", "tokens_per_trip"):
        value = event.get(name)
        row[name] = _number(value) if value is not None else None


class ThroughputMeter:
    """Tokens per second each node served, one sample per ``sample`` call.

    A token counts for every node on its request's route: each of them ran its layers
    for it. Routes come from ``connected`` and ``complete`` events; token totals from
    ``progress`` (running) and ``complete`` (final) events, so only growth is counted.
    """

    def __init__(self, history: int = 150):
        self.history: deque[dict] = deque(maxlen=history)  # {"ts", "tps": {node: tok/s}}
        self._routes: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._counted: OrderedDict[str, int] = OrderedDict()
        self._pending: Counter[str] = Counter()  # tokens per node since the last sample
        self._last_ts: float | None = None

    def observe(self, event: dict) -> None:
        key, kind = event.get("key"), event.get("kind")
        if not isinstance(key, str):
            return
        nodes = tuple(h["node"] for h in _hops(event.get("hops")))
        if nodes:
            self._routes[key] = nodes
        elif key not in self._routes and event.get("node"):
            self._routes[key] = (str(event["node"]),)  # the head, until the route is known
        if kind == "progress":
            self._count(key, int(_number(event.get("tokens"))))
        elif kind in FINAL_KINDS:
            self._count(key, int(_number(event.get("completion_tokens"))))
        _trim(self._routes)

    def sample(self, ts: float, nodes: list[str]) -> dict | None:
        """Close the interval ending at ``ts``; the new sample, or None for the first call."""
        last, self._last_ts = self._last_ts, ts
        if last is None or ts <= last:
            self._pending.clear()
            return None
        span = ts - last
        names = sorted(set(nodes) | set(self._pending))
        point = {"ts": ts, "tps": {n: round(self._pending[n] / span, 3) for n in names}}
        self._pending.clear()
        self.history.append(point)
        return point

    def _count(self, key: str, total: int) -> None:
        grown = total - self._counted.get(key, 0)
        if grown <= 0 or key not in self._routes:
            return
        self._counted[key] = total
        _trim(self._counted)
        for node in self._routes[key]:
            self._pending[node] += grown


def _trim(table: OrderedDict) -> None:
    while len(table) > MAX_TRACKED:
        table.popitem(last=False)
