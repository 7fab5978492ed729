"""How a node answers whoever sent it a frame: on its ROUTER, or back through its relay."""
from __future__ import annotations

import logging

import zmq

from ..net.relay import RelayedPeer
from ..wire import protocol as p

log = logging.getLogger(__name__)


class Replies:
    """The node's ``reply`` (a mixin: the node holds ``router``, ``links`` and ``_gone``)."""

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
