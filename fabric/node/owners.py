"""Who may steer a session on this node: the connection that opened it.

A session id is a secret of its head and the hops of its route (128 random bits the head
issues: fabric/node/route_session.py), so a stranger cannot name one. Knowing it is not
enough either: a FORWARD, CLOSE or CANCEL of a session is acted on only when it arrives on
the connection that opened the session here, which is the previous hop's DEALER, or this
node itself for the head's first hop. A DEALER has a routing id of 16 random bytes, kept
across reconnects (fabric/net/security.py), and a ROUTER refuses a second connection that
claims a routing id in use, so no other connection can speak for it.

The owner of a session's kept KV (an ended session, kept for reuse) is the owner of the
session that ran it: only that connection may start a new session from it (``reuse``).
So kept KV never crosses to a route that did not compute it.

Each session also has the endpoint its head answers at (``reply_to``). When this node's
own link to that endpoint goes down and stays down, the head died: nobody may end its
sessions any more, so the node frees them itself (``orphans``) instead of holding their KV
until the idle timeout.
"""
from __future__ import annotations

from typing import Callable, Collection

SELF = b""  # frames this node gives itself (its head's first hop): a ROUTER never names a peer so

PRUNE_EVERY_S = 5.0  # owners of sessions that hold nothing here any more are forgotten this often


class Owners:
    def __init__(self):
        self._of: dict[str, bytes] = {}  # session -> routing id of the connection that opened it
        self._head: dict[str, str] = {}  # session -> the endpoint its head answers at
        self._pruned_at = 0.0

    def __len__(self) -> int:
        return len(self._of)

    def may_open(self, session: str, identity: bytes, reuse: str = "") -> bool:
        """Whether ``identity`` may open ``session`` (a FORWARD at position 0, or from
        ``reuse``'s kept KV): nobody else owns it, and ``reuse`` is nobody else's either."""
        return self.steers(session, identity) and (not reuse or self.steers(reuse, identity, strict=True))

    def open(self, session: str, identity: bytes, head: str = "") -> None:
        """``identity`` opened ``session`` (its caller asked ``may_open``, or is this node)."""
        self._of[session] = identity
        self._head[session] = head

    def steers(self, session: str, identity: bytes, strict: bool = False) -> bool:
        """Whether frames of ``session`` from ``identity`` are acted on: it opened the session,
        or nobody did (the session holds nothing here: the frame is answered as a cache miss),
        unless ``strict``."""
        owner = self._of.get(session)
        return owner == identity if owner is not None or strict else True

    def known(self, session: str) -> bool:
        """Whether ``session`` was opened here (and holds KV, kept KV or queued work still)."""
        return session in self._of

    def release(self, session: str) -> None:
        self._of.pop(session, None)
        self._head.pop(session, None)

    def heads(self) -> set[str]:
        """The endpoints of the heads of the sessions here."""
        return set(self._head.values()) - {""}

    def orphans(self, dead: set[str]) -> list[str]:
        """Sessions whose head answers at one of the ``dead`` endpoints, forgotten here."""
        gone = [s for s, head in self._head.items() if head in dead]
        for session in gone:
            self.release(session)
        return gone

    def prune(self, now: float, held: Callable[[], Collection[str]]) -> None:
        """Forget, every PRUNE_EVERY_S, the owners of sessions not in ``held()`` (those with KV,
        kept KV or queued work here)."""
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        holds = held()
        self._of = {s: who for s, who in self._of.items() if s in holds}
        self._head = {s: head for s, head in self._head.items() if s in self._of}
