"""meshnet tracker: registry + heartbeats, route planner, stats, usage ledger, PUB updates.

Importing this package pulls in neither torch nor transformers: the tracker starts fast.
"""
from .node_records import NodeInfo
from .planner import CostModel, Plan, PlannedRoute, assign_span, plan_routes
from .registry import Registry
from .service import TrackerConfig, Tracker, serve

__all__ = ["CostModel", "NodeInfo", "Plan", "PlannedRoute", "Registry", "Tracker",
           "TrackerConfig", "assign_span", "plan_routes", "serve"]
