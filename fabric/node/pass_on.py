"""What a node does with a pass's results: each session's next FORWARD, the tail's TOKENs or a
failure, PROGRESS where a long prompt moves; then, once every session of the pass has been
passed on, every step's AUDIT_TAP for its head (fabric/node/audit.py). The taps come last so
that the next hop, and the head waiting for its tokens, start sooner: a tap is only kept for
a later audit (the head waits for a drawn session's last taps before it replays it).
"""
from __future__ import annotations

import dataclasses
import logging
import time

from ..compute.executor import CacheMissError, StepResult
from ..compute.grammar import GrammarError
from ..wire import protocol as p
from .scheduler import Replay, Work

log = logging.getLogger(__name__)


class PassOn:
    """Runs the scheduler's batches and sends what they produced (a mixin: the node holds
    ``hops``, ``scheduler``, ``taps``, ``asks``, ``peers``, ``counters`` and ``config``, and sends
    with ``_send``, ``send_tensors``, ``forward`` and ``_progress``)."""

    def _run(self, batch: list[Work] | list[Replay]) -> None:
        if isinstance(batch[0], Replay):  # an audit's re-run for a head
            self._replay(batch[0])
            return
        results, started, elapsed = self.hops.run(batch)
        self.hops.done()  # the lock goes before the results: the node they wake may wait for it on this machine
        self.scheduler.ran(batch, started, elapsed)
        taps = []
        with self.peers.batched():  # each peer's FORWARDs or TOKENs of this pass in one message
            for work, result in zip(batch, results):
                try:
                    taps.append(self._after_hop(work, result))
                except Exception as exc:
                    log.exception("could not pass on session %s", work.session)
                    self._after_hop(work, exc)
        for tap in filter(None, taps):  # after every session's TOKEN or FORWARD went: the next hop starts sooner
            self._tap(*tap)

    def _replay(self, job: Replay) -> None:
        """A slice of an audit's re-run: the answer once it is all done, else its next turn queued
        (a long replay would hold every stream here up for a prefill's time)."""
        n = self.scheduler.replay_slice(job)
        began = time.perf_counter()
        answer = self.taps.replay(job, n)
        if answer is None:
            self.scheduler.steer_slices(job.session, n, time.perf_counter() - began)
            self.scheduler.resume_replay(job)
        else:
            self.send_tensors(job.msg.reply_to, job.msg.reply_key, *answer)

    def _tap(self, work: Work, result: StepResult, tokens: list[p.Token]) -> None:
        """A step's AUDIT_TAP for its head (every step past the head)."""
        try:
            self.send_tensors(work.msg.reply_to, work.msg.reply_key, *self.taps.tap(work, result, tokens))
        except Exception:
            log.exception("could not tap session %s", work.session)

    def _after_hop(self, work: Work, result: StepResult | Exception) -> tuple | None:
        """Send what a hop produced: the next FORWARD, the tail's TOKEN, or a failure; after each
        piece of a long prefill (all but the tail's last, which its TOKEN answers), PROGRESS to the
        head too: however long the prompt, the head hears it move. Returns what the step's tap
        needs (``_tap``), sent once the whole batch has been passed on; None: no tap."""
        msg = work.msg
        try:  # the tail: what the session asked of its tokens, and the tokens (none at other hops)
            tokens = self.asks.at_tail(msg, msg.pos + work.tokens, result)
        except GrammarError as exc:
            tokens, result = [], exc
        if tokens is None:  # a step sent ahead whose guess did not hold: its positions are cut by the next
            self.counters["void_steps"] += 1
            return None
        tap = (work, result, tokens) if msg.audit and msg.start_layer and isinstance(result, StepResult) else None
        if work.reports_progress and isinstance(result, StepResult) and result.logits is None:
            self._progress(msg, msg.pos + work.tokens)
        if isinstance(result, CacheMissError):
            self.counters["cache_miss"] += 1
            self._send(msg.reply_to, msg.reply_key, p.CacheMiss(msg.session, msg.step, self.config.node_id,
                                                                 result.have))
        elif isinstance(result, Exception):
            code = p.ErrorCode.BAD_REQUEST if isinstance(result, GrammarError) else p.ErrorCode.INTERNAL
            self.counters["hop_errors"] += code == p.ErrorCode.INTERNAL
            self._drop_session(msg.session)
            self._send(msg.reply_to, msg.reply_key, p.Error(code, f"{type(result).__name__}: {result}",
                                                            session=msg.session, step=msg.step, node=self.config.node_id))
        elif tokens:  # the tail: layers end here (a verification step: a TOKEN per draft kept, and one more)
            for token in tokens:
                self._send(msg.reply_to, msg.reply_key, token)
        elif msg.route:
            nxt = msg.route[0]
            out = dataclasses.replace(msg, start_layer=nxt.start_layer, end_layer=nxt.end_layer, route=msg.route[1:],
                                      tensors=())
            self.forward(nxt, out, result.hidden)
        # else: the tail filled its KV with a prefill chunk that more chunks follow
        return tap
