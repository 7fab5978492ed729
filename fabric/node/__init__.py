"""A peer node: it holds a contiguous range of a model's layers and runs hops over them.

- ``node``: the socket loop, which hands each frame to the part whose job it is;
- ``scheduler``: which queued hops run next and when (no sockets, no torch);
- ``hops``: running a batch through the executor under the compute lock;
- ``head``: the requests a node holding layer 0 heads, their clients, failover;
- ``peers``: DEALERs to other nodes, their liveness and round trips;
- ``links``: the tracker and the relay;
- ``config``: ``NodeConfig``, grouped the same way.
"""
from .config import NodeConfig, stable_node_id
from .head import HeadConfig
from .links import LinkConfig
from .node import COUNTERS, Node
from .scheduler import SchedulerConfig, Work

__all__ = ["COUNTERS", "HeadConfig", "LinkConfig", "Node", "NodeConfig", "SchedulerConfig", "Work", "stable_node_id"]
