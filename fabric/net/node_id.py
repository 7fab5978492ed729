"""The id a node goes by where ``--node-id`` names none: kept per (model, layers, bind address),
so that a restarted node is the same node to the tracker and to its peers. No torch: a node
that fetches its layers from peers reports its fetch under this id before torch loads."""
from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from ..wire.shard import Shard


def stable_node_id(data_root: Path, model_id: str, shard: Shard, bind: str) -> str:
    """A node id made once per (model, layers, bind address) and kept in a key file. A node
    bound to port 0 (any free port) has no stable address, so it gets a fresh id."""
    if bind.rstrip("/").endswith((":0", ":*")):
        return "node-" + secrets.token_hex(4)
    slot = hashlib.sha256(f"{model_id}|{shard}|{bind}".encode()).hexdigest()[:16]
    path = data_root / "node-ids" / slot
    if path.is_file():
        return path.read_text().strip()
    node_id = "node-" + secrets.token_hex(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_id + "\n")
    return node_id
