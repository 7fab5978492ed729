"""A node's sessions: who may open, step and end each one, when there is room for one more,
and freeing what nobody may end any more. Part of ``Node`` (fabric/node/node.py), which owns
the sockets, the queue and the KV these methods read.
"""
from __future__ import annotations

import logging

import torch

from ..wire import protocol as p
from .hops import check_forward
from .scheduler import Work

log = logging.getLogger(__name__)

# steps of one session queued at once (a step's prefill chunks count as one): more is BUSY. Three: a step, one its
# head sent ahead of its answer (pipelined speculation), and the step that replaces that one where it was void
MAX_QUEUED_STEPS = 3


class SessionControl:
    """The session rules of ``Node``: see fabric/node/owners.py for who owns a session."""

    def _accept_forward(self, identity: bytes, msg: p.Forward, tensor: torch.Tensor) -> None:
        check_forward(msg, tensor, self.config.shard, self.executor.hidden_size, self.context, self.vocab)
        opens = msg.pos == 0 or bool(msg.reuse)
        if not (self.owners.may_open(msg.session, identity, msg.reuse) if opens
                else self.owners.steers(msg.session, identity)):
            raise p.ProtocolError("that session (or the kept KV it names) belongs to another connection",
                                  p.ErrorCode.BAD_REQUEST)
        if msg.route:
            self.reach(msg.route[0])
        if not opens and not self.owners.known(msg.session):  # nothing of it here: answered now, never queued
            self.counters["cache_miss"] += 1
            self._send(msg.reply_to, msg.reply_key, p.CacheMiss(msg.session, msg.step, self.config.node_id, 0))
            return
        if self.departure.refuses(msg, msg.session in self.kv):
            self._send(msg.reply_to, msg.reply_key, self.departure.refusal(msg.session, msg.step))
            return
        if self.busy(msg.session) if opens else self._crowds(msg, tensor.shape[1]):
            self._send(msg.reply_to, msg.reply_key, p.Error(p.ErrorCode.BUSY, "node is at its session or queue limit",
                                                            session=msg.session, step=msg.step,
                                                            node=self.config.node_id))
            return
        if opens:
            self.owners.open(msg.session, identity, head=msg.reply_to)
            self.peers.dial(msg.reply_to, msg.reply_key)  # its link tells when the head dies (``_free_orphans``)
        self.scheduler.push(Work(msg, tensor))

    def reach(self, hop: p.Hop) -> None:
        """Open the link to ``hop``, the next after this node's span, or raise ProtocolError
        (BAD_REQUEST) when no one can dial it: refused before the span runs, not dropped after."""
        if hop.endpoint != self.endpoint:
            self.peers.resolve(hop.endpoint, hop.key)

    def _refuse_forward(self, identity: bytes, msg: p.Forward, exc: p.ProtocolError) -> None:
        """A step this node will not run. The refusal names its session and step, and goes to
        the sender and also where the step's token would have gone, the head (as BUSY does),
        which ends that request with the reason: a hop before the head could place it nowhere,
        and the client waited out its timeouts. (The head, when it sent the step, hears it twice;
        the second finds the request ended.)"""
        self.counters["rejected_frames"] += 1
        log.warning("refused a step of session %.16s… from %r: %s", msg.session, identity, exc)
        error = p.Error(exc.code, str(exc), session=msg.session, step=msg.step, node=self.config.node_id)
        self.reply(identity, error)
        if msg.reply_to:
            self._send(msg.reply_to, msg.reply_key, error)

    def busy(self, opening: str = "") -> bool:
        """No room for a session ``opening`` here ("": a new one): the sessions holding KV
        here and those whose first hop waits in the queue reach the session limit."""
        if opening in self.kv:
            return False
        waiting = {w.session for w in self.scheduler.queue} - set(self.kv.sessions()) - {opening}
        return len(self.kv) + len(waiting) >= self.config.max_sessions

    def _crowds(self, msg: p.Forward, tokens: int) -> bool:
        """``msg``, a step of a session here, would queue more than an honest session can: more
        steps than MAX_QUEUED_STEPS (the head sends one when the last one's token came, and one
        ahead of it), positions already queued (but a step sent ahead's, which the next may cut
        off), or more positions than the model's context. So a session's queue costs at most one
        context's prefill, and nobody's flood turns another's steps away."""
        mine = [w for w in self.scheduler.queue if w.session == msg.session]
        if not mine:
            return False
        steps = {w.msg.step for w in mine} | {msg.step}
        start = min(w.msg.pos for w in mine)
        end = max((w.msg.pos + w.tokens for w in mine if w.msg.guess < 0), default=0)
        return len(steps) > MAX_QUEUED_STEPS or msg.pos < end or msg.pos + tokens - start > max(self.context, 1)

    def _end(self, identity: bytes, msg: p.Cancel | p.Close) -> None:
        """A client cancels a request this node heads (its own: ``session`` is its request id),
        or a session ends along its route: acted on only from the connection that opened it."""
        if isinstance(msg, p.Cancel) and self.head is not None and self.head.cancel(identity, msg.session):
            return
        if self.owners.steers(msg.session, identity, strict=True):
            self._free(msg)
        else:
            self.counters["rejected_frames"] += 1
            log.info("ignored a %s for a session %r does not steer", type(msg).__name__.upper(), identity)

    def _free(self, msg: p.Cancel | p.Close) -> None:
        """End the session here (its KV kept for reuse while the budget allows, its queued work
        dropped), then pass the message down the route."""
        self.scheduler.drop(msg.session)
        self.asks.forget(msg.session)
        for evicted in self.executor.retain(msg.session):
            log.debug("evicted the kept KV of session %s", evicted)
        if msg.route:
            nxt = msg.route[0]
            self._send(nxt.endpoint, nxt.key, type(msg)(session=msg.session, route=msg.route[1:]))

    def _drop_session(self, session: str) -> None:
        """Forget ``session`` here: its KV, its row in the executor's batch, its queued hops."""
        self.kv.drop(session)
        self.asks.forget(session)
        self.executor.free_row(session)
        self.scheduler.drop(session)

    def _free_orphans(self, now: float) -> None:
        """Free the sessions (live or kept) of heads whose link from here went down and stayed
        down: no one is left who may end them. (A head that is only slow to answer keeps them:
        its next step would find them gone and prefill again.)"""
        if not self.peers.liveness.any_down:  # the loop's usual turn: nothing to look through
            return
        dead = self.peers.liveness.down(self.owners.heads() - {self.endpoint}, now)
        for session in self.owners.orphans(dead) if dead else ():
            self._drop_session(session)
            self.kv.retained.pop(session)
            log.info("freed session %s: its head at %s is gone", session, ", ".join(dead))
