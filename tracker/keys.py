"""Which CURVE key each node id belongs to, in a secured swarm.

A node id is bound to the key that registered it once the registration is accepted, kept
while the node is registered and, in a bounded list, a while after it departs: no member can
register, heartbeat, report or audit as another.

In plaintext there are no keys, and a node id goes to whoever registers it last; but audit
messages (REPLICAS_REQUEST, VERDICT), which can exclude another node, are taken only from the
connection that registered the head they name: the node's DEALER to the tracker, whose routing
id is 16 random bytes kept for the node's life (fabric/net/security.py).
"""
from __future__ import annotations

from collections import OrderedDict

from fabric.net.security import Security
from fabric.wire.protocol import (
    ErrorCode,
    Heartbeat,
    Leave,
    Message,
    ProtocolError,
    Register,
    ReplicasRequest,
    Report,
    Verdict,
)

# node ids of departed nodes (expired or left) whose key binding is kept, least recently
# departed dropped first: a leaving head's last reports still go under its key, and nobody
# takes the id over at once; beyond this many the id is free, as after a tracker restart
MAX_DEPARTED_KEYS = 1024
BOUND = (Register, Heartbeat, Report, Leave, Verdict, ReplicasRequest)  # messages that speak for a node id
AUDITS = (Verdict, ReplicasRequest)  # messages that can exclude another node


class KeyBook:
    def __init__(self, security: Security | None):
        self.security = security
        self.nodes: dict[str, str] = {}  # registered node id -> the CURVE key it registered with
        self.departed: OrderedDict[str, str] = OrderedDict()  # the same for departed ids (MAX_DEPARTED_KEYS)
        self._allowed: set[str] | None = None  # allow-listed public keys, read on first use
        self.connections: dict[str, bytes] = {}  # plaintext: registered node id -> its connection's routing id

    def authorize(self, message: Message, peer: str | None, connection: bytes = b"") -> None:
        """ProtocolError unless ``peer`` (the CURVE key; in plaintext ``connection``, the
        sender's routing id) may speak for the node id ``message`` names."""
        if self.security is None and isinstance(message, AUDITS):
            if self.connections.get(message.node_id) != connection:
                raise ProtocolError(f"node id {message.node_id!r} is not registered on this connection",
                                    ErrorCode.BAD_REQUEST)
            return
        if self.security is None or not isinstance(message, BOUND):
            return
        owner = self.nodes.get(message.node_id) or self.departed.get(message.node_id)
        if owner is not None and owner != peer:
            raise ProtocolError(f"node id {message.node_id!r} belongs to another key", ErrorCode.BAD_REQUEST)
        if owner is None and isinstance(message, AUDITS):  # audits are by registered heads
            raise ProtocolError(f"node id {message.node_id!r} is not registered", ErrorCode.BAD_REQUEST)

    def registered(self, node_id: str, peer: str, connection: bytes = b"") -> None:
        """``node_id``'s registration was accepted: it is ``peer``'s (in plaintext, ``connection``'s)."""
        if self.security is None:
            self.connections[node_id] = connection
        else:
            self.nodes[node_id] = peer
            self.departed.pop(node_id, None)

    def departs(self, node_id: str) -> None:
        """``node_id`` expired or left: its binding moves to the bounded list of departed ids."""
        self.connections.pop(node_id, None)
        key = self.nodes.pop(node_id, None)
        if key is not None:
            self.departed.pop(node_id, None)
            self.departed[node_id] = key
            while len(self.departed) > MAX_DEPARTED_KEYS:
                self.departed.popitem(last=False)

    def hop_key(self, msg: Register, peer: str) -> str:
        """The key peers dial a node with: its own, or its relay's when it is relayed (that key
        must be on the tracker's allow-list: the relay is a member of the swarm)."""
        if self.security is None or not msg.relay:
            return peer
        if not msg.relay_key:
            raise ProtocolError("a relayed node in a secured swarm must name its relay's key", ErrorCode.BAD_REQUEST)
        if msg.relay_key not in self._allowed_keys():
            raise ProtocolError("the relay's key is not on the tracker's allow-list", ErrorCode.BAD_REQUEST)
        return msg.relay_key

    def _allowed_keys(self) -> set[str]:
        import zmq.auth

        if self._allowed is None:  # read once, like the ZAP handler's allow-list
            self._allowed = {k.decode() for k in zmq.auth.load_certificates(str(self.security.allowed))}
        return self._allowed
