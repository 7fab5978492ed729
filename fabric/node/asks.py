"""The tail's side of what a session asks of its tokens: logprobs, penalties, logit_bias, a grammar.

A session asks once, on the FORWARDs that open it (pos 0, or from kept KV: ``logprobs`` >= 0,
``penalties``); every later step is as cheap as any other session's. So the tail remembers
the ask per session, and forgets it with the session. A session that asked nothing costs one
lookup in a map that is empty unless some session asked, and its TOKENs carry no logprob
field at all (``Token.SPARSE``).

Penalties and logit_bias change the logits the tail samples from (OpenAI's formula, as vLLM
applies it: ``Penalties``); the counts start from the tokens the opening FORWARD lists (those
generated before a re-prefill) and grow with each token sampled here. Logprobs are vLLM's
default (``raw_logprobs``): the log-softmax of the raw logits, before penalties, bias,
temperature, top-k or top-p. They describe the model, not the sampler, so greedy and sampled
requests report the same numbers for the same position.
A grammar (``response_format``) masks the logits last, after penalties and bias, so no
sampler setting can pick a token it forbids; its matcher is rebuilt from the generated tokens
the opening FORWARD lists (``Grammars.matcher``) and advanced with each token sampled here.
No sockets here: the node sends the TOKEN this builds.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..compute.grammar import GrammarError, Grammars, Matcher
from ..compute.sampling import accept, sample
from ..wire import protocol as p

MAX_ASKING_SESSIONS = 4096  # sessions whose ask the tail keeps; beyond it the oldest is forgotten


@dataclass
class Ask:
    """What one session asked, and (for penalties) the tokens generated so far."""

    logprobs: int = -1  # alternatives its TOKENs list; -1: no logprobs
    penalties: p.Penalties | None = None
    counts: Counter = field(default_factory=Counter)  # token id -> times generated in this request
    matcher: Matcher | None = None  # the session's place in its grammar; None: free text

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (vocab,) with the bias added and the penalties taken off, as a float32 copy."""
        pen = self.penalties
        out = logits.float()  # (vocab,)
        # numpy copies a CPU row on this thread; torch's clone would wake its thread pool for it (~20x slower here)
        out = torch.from_numpy(out.numpy().copy()) if out.device.type == "cpu" else out.clone()
        if self.counts and (pen.presence or pen.frequency):
            ids = torch.tensor(list(self.counts), dtype=torch.int64, device=out.device)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=out.device)
            out.index_add_(0, ids, -(pen.frequency * counts + pen.presence))
        if pen.bias_ids:
            out.index_add_(0, torch.tensor(pen.bias_ids, device=out.device),
                           torch.tensor(pen.bias_values, dtype=torch.float32, device=out.device))
        return out


class SessionAsks:
    """Session id -> its ``Ask``. Entries are written only by the FORWARDs of a session this
    node accepted (its owner's), and dropped when the session ends here, is dropped, or is no
    longer known (``keep``)."""

    def __init__(self, grammars: Grammars | None = None, bound: int = MAX_ASKING_SESSIONS):
        self._asks: dict[str, Ask] = {}
        # session -> (pos, token) of the last TOKEN of its last verification step here: what a step sent ahead
        # of that one's answer (FORWARD ``guess``) assumed, and runs only where it holds
        self._answered: dict[str, tuple[int, int]] = {}
        self.grammars = grammars  # compiles the grammars sessions ask for; None: none can be asked
        self.bound = bound

    def __len__(self) -> int:
        return len(self._asks)

    def note(self, msg: p.Forward) -> None:
        """Remember what ``msg``'s session asked: a step that says (the opening step, or a piece
        this node cut it into), or one that opens the session and asks nothing (then nothing,
        whatever an earlier session of that id asked). A grammar that does not compile, or that
        the generated tokens break, raises GrammarError (the session gets a bad_request)."""
        if msg.logprobs >= 0 or msg.penalties is not None or msg.grammar is not None:
            self._asks.pop(msg.session, None)
            generated = msg.penalties.generated if msg.penalties is not None else ()
            matcher = self._matcher(msg.grammar) if msg.grammar is not None else None
            self._put(self._asks, msg.session, Ask(msg.logprobs, msg.penalties, Counter(generated), matcher))
        elif self._asks and (msg.pos == 0 or msg.reuse):
            self._asks.pop(msg.session, None)

    def at_tail(self, msg: p.Forward, pos: int, result) -> list[p.Token] | None:
        """What the tail does with a step that ran (``result`` a StepResult): note what the
        session asks, and the TOKEN sampled from its logits for position ``pos`` (a
        verification step's: ``verify``, one TOKEN per position kept). [] at any other hop, for a
        failed step, and for a prefill chunk that more chunks follow (no logits). None for a step
        sent ahead whose guess did not hold (``guess``): void, it answers nothing."""
        if msg.route or isinstance(result, Exception):
            return []
        self.note(msg)
        logits = getattr(result, "logits", None)
        if logits is None:
            return []
        if not msg.drafts or result.verify is None:
            return [self.token(msg, pos, logits)]
        if msg.guess >= 0 and self._answered.get(msg.session) != (msg.pos, msg.guess):
            return None
        tokens = self.verify(msg, pos - len(msg.drafts), result.verify)
        self._put(self._answered, msg.session, (tokens[-1].pos, tokens[-1].token))
        return tokens

    def _put(self, table: dict, session: str, value) -> None:
        """``table[session] = value``, newest last; past ``bound`` sessions the oldest is forgotten."""
        table.pop(session, None)
        table[session] = value
        if len(table) > self.bound:
            del table[next(iter(table))]

    def verify(self, msg: p.Forward, pos: int, rows) -> list[p.Token]:
        """The TOKENs of a verification step: for positions pos, pos + 1, ..., each sampled from
        its row of ``rows`` (len(drafts) + 1, vocab) exactly as a one-token step there would
        sample it (the same draw of (seed, position), the penalties and grammar advanced by
        the tokens before it), until one differs from the draft in its place, or the drafts
        run out: every draft kept is a token this tail would have sampled, and the last TOKEN
        is the one after them. With a temperature this is the standard acceptance rule for a
        deterministic draft (a point mass): the draft is kept with probability p(draft), and
        otherwise the token comes from p without it, renormalized. A draft model's drafts of a
        sampling request come with the distribution q each was drawn from (``draft_q``): each
        is kept with min(1, p/q), else the token comes from norm(max(0, p - q))
        (``sampling.accept``)."""
        tokens = []
        for i, logits in enumerate(rows):
            drafted = (msg.drafts[i], msg.draft_q[i]) if msg.draft_q and i < len(msg.drafts) else None
            tokens.append(self.token(msg, pos + i, logits, drafted))
            if i == len(msg.drafts) or tokens[-1].token != msg.drafts[i]:
                break
        return tokens

    def token(self, msg: p.Forward, pos: int, logits: torch.Tensor,
              drafted: tuple[int, p.DraftDist] | None = None) -> p.Token:
        """The TOKEN sampled from ``logits`` (vocab,) for position ``pos``, as the session asked;
        ``drafted``: a draft model's token there and its q, kept or corrected by the acceptance rule."""
        def pick(final: torch.Tensor) -> int:
            return accept(final, msg.sampling, pos, *drafted) if drafted else sample(final, msg.sampling, pos)

        ask = self._asks.get(msg.session) if self._asks else None
        if ask is None:
            return p.Token(msg.session, msg.step, pick(logits), pos)
        sampled = ask.adjust(logits) if ask.penalties is not None else logits
        if ask.matcher is not None:
            sampled = ask.matcher.mask(sampled, owned=ask.penalties is not None)
        token = pick(sampled)
        if ask.penalties is not None:
            ask.counts[token] += 1
        if ask.matcher is not None:
            ask.matcher.advance(token)
        if ask.logprobs < 0:
            return p.Token(msg.session, msg.step, token, pos)
        logprob, top_ids, top_logprobs = logprobs_of(logits, token, ask.logprobs)
        return p.Token(msg.session, msg.step, token, pos, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)

    def _matcher(self, grammar: p.Grammar) -> Matcher:
        if self.grammars is None:
            raise GrammarError("this node cannot apply grammars")
        return self.grammars.matcher(grammar)

    def forget(self, session: str) -> None:
        if self._asks:
            self._asks.pop(session, None)
        if self._answered:
            self._answered.pop(session, None)

    def keep(self, known) -> None:
        """Forget the asks of sessions for which ``known(session)`` is False (ended, evicted)."""
        if self._asks:
            self._asks = {s: ask for s, ask in self._asks.items() if known(s)}
        if self._answered:
            self._answered = {s: last for s, last in self._answered.items() if known(s)}


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[int, ...], tuple[float, ...]]:
    """The log-softmax of ``logits`` (vocab,) at ``token`` and at the ``top`` likeliest ids,
    likeliest first, each clamped to MIN_LOGPROB (a masked logit's -inf)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (vocab,)
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1])) if top else (logprobs[:0], logprobs[:0])
    clamp = lambda x: min(0.0, max(p.MIN_LOGPROB, float(x)))  # noqa: E731
    return (clamp(logprobs[token]), tuple(int(i) for i in ids.tolist()),
            tuple(clamp(v) for v in values.tolist()))
