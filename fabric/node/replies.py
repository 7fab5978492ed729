"""How a node answers whoever sent it a frame: on its ROUTER, or back through its relay."""
from __future__ import annotations

import logging

import zmq

from ..net.relay import RelayedPeer
from ..net.security import peer_key
from ..wire import protocol as p

log = logging.getLogger(__name__)


class Replies:
    """The node's ``reply``, and who sent a frame (a mixin: the node holds ``router``, ``links``,
    ``_gone``, ``config`` and ``key``)."""

    def reply(self, identity: bytes, message: p.Message | None, buffers: list = ()) -> None:
        if message is None:
            return
        if isinstance(identity, RelayedPeer):  # the peer reached us through our relay's front
            self.links.reply_relayed(identity, p.encode(message, buffers))
        elif identity:
            try:
                self.router.send_multipart([identity, *p.encode(message, buffers)], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.warning("client %r is not reading; dropped an event", identity)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._gone.add(identity)

    def _sender(self, frames: list) -> str:
        """The CURVE key the frames came with: this node's own when it sent them to itself; "" in plaintext."""
        if self.config.security is None:
            return ""
        if not isinstance(frames[-1], zmq.Frame):
            return self.key  # in-process: from this very node
        return peer_key(frames[-1]) or ""
