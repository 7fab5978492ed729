"""How a node answers whoever sent it a frame: on its ROUTER, or back through its relay."""
from __future__ import annotations

import logging
import time

import zmq

from ..net.relay import RelayedPeer
from ..net.security import peer_key
from ..wire import protocol as p

log = logging.getLogger(__name__)

WARN_WINDOW_S = 10.0  # a throttled warning is logged one by one at most WARN_BURST times a window
WARN_BURST = 5


class Throttled:
    """One kind of warning a peer can cause at will (a frame rejected, an event it does not read):
    the first WARN_BURST of each WARN_WINDOW_S logged one by one, then one line that says so, and
    the rest as one count when the next window opens. A peer that floods a node cannot fill its
    disk with a line each; every occurrence is still counted where the node counts it (/metrics)."""

    def __init__(self, what: str):
        self.what = what  # the summary's words: "frames rejected"
        self._opened = float("-inf")
        self._logged = self._quiet = 0

    def warn(self, now: float, message: str, *args) -> None:
        if now - self._opened >= WARN_WINDOW_S:
            if self._quiet:
                log.warning("%d more %s in %.0f s, not logged one by one", self._quiet, self.what, WARN_WINDOW_S)
            self._opened, self._logged, self._quiet = now, 0, 0
        if self._logged < WARN_BURST:
            self._logged += 1
            log.warning(message, *args)
            return
        if not self._quiet:
            log.warning("more %s: counted, and not logged one by one for %.0f s", self.what, WARN_WINDOW_S)
        self._quiet += 1


class Replies:
    """The node's ``reply``, its answer to a frame it rejects, and who sent a frame (a mixin: the
    node holds ``router``, ``links``, ``_gone``, ``config``, ``key`` and ``counters``)."""

    _rejected_log = _dropped_log = None  # Throttled, made at the first warning

    def _rejected(self, identity: bytes, exc: p.ProtocolError) -> None:
        self.counters["rejected_frames"] += 1
        self._rejected_log = self._rejected_log or Throttled("frames rejected")
        self._rejected_log.warn(time.monotonic(), "rejected frame from %r: %s", identity, exc)
        self.reply(identity, p.Error(exc.code, str(exc), node=self.config.node_id))

    def reply(self, identity: bytes, message: p.Message | None, buffers: list = ()) -> None:
        if message is None:
            return
        if isinstance(identity, RelayedPeer):  # the peer reached us through our relay's front
            self.links.reply_relayed(identity, p.encode(message, buffers))
        elif identity:
            try:
                self.router.send_multipart([identity, *p.encode(message, buffers)], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._dropped_log = self._dropped_log or Throttled("events dropped for clients not reading")
                self._dropped_log.warn(time.monotonic(), "client %r is not reading; dropped an event", identity)
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
