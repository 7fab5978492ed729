"""The tail's side of logprobs: which sessions asked for them, and what their TOKENs carry.

A session asks once, on the FORWARDs that open it (``logprobs`` >= 0 at pos 0, or from kept
KV); every later step is as cheap as any other session's. So the tail remembers the ask per
session, and forgets it with the session. A session that did not ask costs one lookup in a
map that is empty unless some session asked, and its TOKENs carry no logprob field at all
(``Token.SPARSE``).

The logprobs are vLLM's default (``raw_logprobs``): the log-softmax of the raw logits the
token was sampled from, before temperature, top-k or top-p. They describe the model, not the
sampler, so greedy and sampled requests report the same numbers for the same position.
No sockets here: the node sends the TOKEN this builds.
"""
from __future__ import annotations

import torch

from ..wire import protocol as p

MAX_ASKING_SESSIONS = 4096  # sessions whose ask the tail keeps; beyond it the oldest is forgotten


class LogprobAsks:
    """Session id -> how many alternatives its TOKENs list. Entries are written only by the
    FORWARDs of a session this node accepted (its owner's), and dropped when the session
    ends here, is dropped, or is no longer known (``keep``)."""

    def __init__(self, bound: int = MAX_ASKING_SESSIONS):
        self._top: dict[str, int] = {}
        self.bound = bound

    def __len__(self) -> int:
        return len(self._top)

    def note(self, msg: p.Forward) -> None:
        """Remember what ``msg``'s session asked: a step that says (logprobs >= 0), or one that
        opens the session and says nothing (no logprobs, whatever an earlier session of that id
        asked)."""
        if msg.logprobs >= 0:
            self._top.pop(msg.session, None)
            self._top[msg.session] = msg.logprobs
            if len(self._top) > self.bound:
                del self._top[next(iter(self._top))]
        elif self._top and (msg.pos == 0 or msg.reuse):
            self._top.pop(msg.session, None)

    def token(self, msg: p.Forward, token: int, pos: int, logits: torch.Tensor) -> p.Token:
        """The TOKEN for ``token`` sampled from ``logits`` (vocab,), with logprobs if the session asked."""
        top = self._top.get(msg.session) if self._top else None
        if top is None:
            return p.Token(msg.session, msg.step, token, pos)
        logprob, top_ids, top_logprobs = logprobs_of(logits, token, top)
        return p.Token(msg.session, msg.step, token, pos, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)

    def forget(self, session: str) -> None:
        if self._top:
            self._top.pop(session, None)

    def keep(self, known) -> None:
        """Forget the asks of sessions for which ``known(session)`` is False (ended, evicted)."""
        if self._top:
            self._top = {s: n for s, n in self._top.items() if known(s)}


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[int, ...], tuple[float, ...]]:
    """The log-softmax of ``logits`` (vocab,) at ``token`` and at the ``top`` likeliest ids,
    likeliest first, each clamped to MIN_LOGPROB (a masked logit's -inf)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (vocab,)
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else (logprobs[:0], logprobs[:0])
    clamp = lambda x: min(0.0, max(p.MIN_LOGPROB, float(x)))  # noqa: E731
    return (clamp(logprobs[token]), tuple(int(i) for i in ids.tolist()),
            tuple(clamp(v) for v in values.tolist()))
