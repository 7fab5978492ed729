"""Who holds what: registered nodes, their load, and heartbeat expiry.

The registry is plain in-memory state owned by the tracker's service loop (one thread);
it never touches a socket. A restarted tracker starts empty and is repopulated when the
nodes' heartbeats are answered with UNKNOWN_NODE and they register again.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from fabric.wire.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS
from fabric.wire.protocol import ErrorCode, Heartbeat, ProtocolError, Register, check_heartbeat, check_register

from .node_records import NodeInfo

log = logging.getLogger(__name__)

EXCLUSION_S = 3600.0  # an audit's exclusion lapses after this unless another settled verdict confirms it
MAX_EXCLUDED = 4096  # exclusions kept at once (ids need not be registered: the bound is a bound)


@dataclass(frozen=True)
class Exclusion:
    """Why and until when an audit left a node out of plans."""

    reason: str  # the verdict, its witnesses and the distance measured, in words
    until: float  # registry clock: it lapses then
    confirmations: int = 1  # settled verdicts that excluded or confirmed it


class Registry:
    """Registered nodes keyed by node id, with heartbeat-based expiry.

    ``version`` increases on every topology change (a node joins, leaves, changes its
    shard or endpoint, or crosses its session limit), so callers can republish plans.
    """

    def __init__(self, heartbeat_interval: float = HEARTBEAT_INTERVAL, expiry_missed: int = HEARTBEAT_LIVENESS,
                 clock: Callable[[], float] = time.monotonic):
        if heartbeat_interval <= 0 or expiry_missed < 1:
            raise ValueError("heartbeat_interval must be > 0 and expiry_missed >= 1")
        self.expiry_s = heartbeat_interval * expiry_missed
        self._clock = clock
        self._nodes: dict[str, NodeInfo] = {}
        # fingerprint -> (its layer count, live nodes registered with it): the first node of a
        # fingerprint sets the count, later ones must agree; dropped with its last node
        self._layer_counts: dict[str, tuple[int, int]] = {}
        self.version = 0
        self.exclusions: dict[str, Exclusion] = {}  # node id -> an audit's exclusion (outlives expiry, not its term)

    def register(self, msg: Register, public_key: str = "") -> NodeInfo:
        """Add or replace a node (load starts at zero). Validates first."""
        check_register(msg)
        old = self._nodes.get(msg.node_id)
        self._check_layer_count(msg, old)
        node = NodeInfo(
            node_id=msg.node_id, endpoint=msg.endpoint, model=msg.model,
            fingerprint=msg.fingerprint, num_layers=msg.num_layers,
            start_layer=msg.start_layer, end_layer=msg.end_layer,
            hardware=dict(msg.hardware), benchmark=msg.benchmark,
            max_sessions=msg.max_sessions, last_seen=self._clock(), public_key=public_key, relay=msg.relay)
        if old is not None:
            self._uncount(old)
        self._nodes[msg.node_id] = node
        layers, holders = self._layer_counts.get(node.fingerprint, (node.num_layers, 0))
        self._layer_counts[node.fingerprint] = (layers, holders + 1)
        if old is None or old.topology_key() != node.topology_key():
            self.version += 1
            log.info("node %s registered: %s layers %d-%d at %s", node.node_id, node.model,
                     node.start_layer, node.end_layer, node.endpoint)
        return node

    def heartbeat(self, msg: Heartbeat) -> NodeInfo | None:
        """Refresh a node's liveness and load; None if the node is unknown (re-register)."""
        check_heartbeat(msg)
        old = self._nodes.get(msg.node_id)
        if old is None:
            return None
        node = replace(old, sessions=msg.sessions, queued=msg.queued, last_seen=self._clock(),
                       rtts=dict(msg.rtts), kv_bytes=msg.kv_bytes, kv_hits=msg.kv_hits, kv_misses=msg.kv_misses)
        self._nodes[msg.node_id] = node
        if node.at_capacity != old.at_capacity or node.rtts.keys() != old.rtts.keys():
            self.version += 1  # plans change with load limits and with what is known of links
        return node

    def set_reachable(self, node_id: str, endpoint: str, reachable: bool) -> NodeInfo | None:
        """Record a reachability check of ``endpoint`` (ignored if the node moved since)."""
        node = self._nodes.get(node_id)
        if node is None or node.endpoint != endpoint:
            return None
        self._nodes[node_id] = node = replace(node, reachable=reachable)
        return node

    def expire(self) -> list[NodeInfo]:
        """Drop nodes that missed ``expiry_missed`` heartbeats (returns them), and exclusions whose term ended."""
        self._lapse()
        deadline = self._clock() - self.expiry_s
        gone = [n for n in self._nodes.values() if n.last_seen < deadline]
        for node in gone:
            del self._nodes[node.node_id]
            self._uncount(node)
            log.warning("node %s expired (no heartbeat for %.1fs)", node.node_id, self.expiry_s)
        if gone:
            self.version += 1
        return gone

    def remove(self, node_id: str) -> NodeInfo | None:
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._uncount(node)
            self.version += 1
        return node

    def _check_layer_count(self, msg: Register, old: NodeInfo | None) -> None:
        """Every node of one fingerprint (one config and set of weights) has the same layer
        count: the first to register sets it, while any node of that fingerprint is live."""
        layers, holders = self._layer_counts.get(msg.fingerprint, (msg.num_layers, 0))
        if old is not None and old.fingerprint == msg.fingerprint and holders == 1:
            return  # the only holder registers again
        if layers != msg.num_layers:
            raise ProtocolError(
                f"num_layers {msg.num_layers} disagrees with the {layers} layers that the nodes of fingerprint "
                f"{msg.fingerprint[:64]!r} registered with", ErrorCode.BAD_REQUEST)

    def _uncount(self, node: NodeInfo) -> None:
        layers, holders = self._layer_counts[node.fingerprint]
        if holders > 1:
            self._layer_counts[node.fingerprint] = (layers, holders - 1)
        else:
            del self._layer_counts[node.fingerprint]

    def exclude(self, node_id: str, reason: str, term: float = EXCLUSION_S) -> Exclusion:
        """Leave ``node_id`` out of every plan for ``term`` seconds from now (an audit caught it
        lying); an exclusion in force is confirmed: its term starts again."""
        old = self.exclusions.pop(node_id, None)
        if old is None and len(self.exclusions) >= MAX_EXCLUDED:
            self.exclusions.pop(min(self.exclusions, key=lambda n: self.exclusions[n].until))
        self.exclusions[node_id] = new = Exclusion(reason, self._clock() + term, old.confirmations + 1 if old else 1)
        if old is None:
            self.version += 1
        return new

    @property
    def excluded(self) -> dict[str, str]:
        """Node id -> why an audit excluded it, for the exclusions in force."""
        now = self._clock()
        return {n: e.reason for n, e in self.exclusions.items() if e.until > now}

    def excluded_for(self, node_id: str) -> float:
        """Seconds ``node_id`` stays excluded (0: it is not)."""
        exclusion = self.exclusions.get(node_id)
        return max(0.0, exclusion.until - self._clock()) if exclusion else 0.0

    def _lapse(self) -> None:
        now = self._clock()
        for node_id in [n for n, e in self.exclusions.items() if e.until <= now]:
            log.warning("node %s: its exclusion by an audit lapsed (not confirmed within its term)", node_id)
            del self.exclusions[node_id]
            self.version += 1

    def get(self, node_id: str) -> NodeInfo | None:
        return self._nodes.get(node_id)

    def snapshot(self, everyone: bool = False) -> tuple[NodeInfo, ...]:
        """An immutable view, ordered by node id: the nodes plans may use, or with ``everyone``
        also those audits excluded."""
        excluded = () if everyone else self.excluded
        return tuple(self._nodes[k] for k in sorted(self._nodes) if everyone or k not in excluded)

    def models(self) -> list[str]:
        return sorted({n.model for n in self._nodes.values()})

    def age(self, node: NodeInfo) -> float:
        """Seconds since the node was last heard from."""
        return max(0.0, self._clock() - node.last_seen)

    def __len__(self) -> int:
        return len(self._nodes)
