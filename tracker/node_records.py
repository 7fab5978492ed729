"""A registered node as the planner, the status view and the registry see it: a plain record,
kept apart from the registry's state so that the pure planner and the views import a
dataclass, not the module that owns and mutates the live set."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeInfo:
    """One registered node as the planner and the status view see it."""

    node_id: str
    endpoint: str
    model: str
    fingerprint: str  # config + weight digest; only equal fingerprints share a route
    num_layers: int  # the model's layer count as the node loaded it
    start_layer: int  # first layer this node holds (inclusive)
    end_layer: int  # last layer this node holds (inclusive)
    hardware: dict = field(default_factory=dict, hash=False, compare=False)
    benchmark: float = 0.0  # layer-steps/s measured at start-up; 0: unknown
    max_sessions: int = 0  # concurrent sessions it accepts; 0: no limit
    sessions: int = 0  # active sessions at the last heartbeat
    queued: int = 0  # requests waiting at the last heartbeat
    last_seen: float = 0.0  # registry clock at the last register/heartbeat
    public_key: str = ""  # CURVE key peers dial it with (secured swarms; its relay's when relayed); hops carry it
    relay: str = ""  # control endpoint of the relay whose front ``endpoint`` is; "": reached directly
    rtts: dict = field(default_factory=dict, hash=False, compare=False)  # peer id -> round trip ms it measured
    reachable: bool | None = None  # whether the tracker reached ``endpoint`` (None: not checked yet)
    kv_bytes: int = 0  # bytes of ended sessions' KV it keeps for reuse, at the last heartbeat
    kv_hits: int = 0  # requests that started from its kept KV (since it started)
    kv_misses: int = 0  # requests that asked for kept KV it no longer held

    @property
    def layers(self) -> tuple[int, int]:
        return (self.start_layer, self.end_layer)

    @property
    def at_capacity(self) -> bool:
        return self.max_sessions > 0 and self.sessions >= self.max_sessions

    def topology_key(self) -> tuple:
        """What the planner's routes depend on, apart from load."""
        return (self.endpoint, self.model, self.fingerprint, self.num_layers,
                self.start_layer, self.end_layer, self.benchmark, self.max_sessions,
                self.at_capacity, self.relay, self.public_key)
