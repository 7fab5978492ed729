"""A draft model at the head (``meshnet node --draft MODEL``): a small model, whole, in the
head's own process, that guesses the next tokens of the requests the head heads.

Prompt lookup (fabric/node/speculation.py ``Lookup``) drafts well where text repeats and
finds little in open chat; a small model of the same family guesses open text too (a 1B
drafting for an 8B keeps most of its guesses on ordinary prose). The head runs it k times
per trip, one token at a time, before it sends the step; the hops verify the drafts as
they verify prompt lookup's (one pass, rejected positions cut off).

Each session keeps its own KV in the draft model (``fed``: the tokens it holds). When the
tail rejected a draft, the next step's history differs from what the draft model was fed
after the common prefix: its KV is cut back to that prefix by truncation
(``HopKV.roll_back``), never copied, and the tokens taken since are fed as one chunk.

A sampling request gets the distribution q each draft was drawn from (its own cut of the
draft's logits, the ``MAX_DRAFT_Q`` likeliest tokens), so the tail can apply the standard
acceptance rule (fabric/compute/sampling.py ``accept``); a greedy one drafts the argmax.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from ..compute.executor import ShardExecutor
from ..compute.hopkv import CacheMissError
from ..compute.kv import KVStore
from ..compute.model_ref import ModelError, ModelSource
from ..compute.sampling import propose
from ..wire.protocol import MAX_DRAFT_Q, DraftDist, Sampling
from ..wire.shard import Shard

log = logging.getLogger(__name__)

MAX_DRAFT_SESSIONS = 256  # sessions whose draft KV the head keeps; past it the least recently drafted goes
WARM_UP = "warm-up"  # the session of the pass run at load (no request's: theirs are random secrets)


def check_vocabulary(draft_tokenizer, tokenizer, name: str) -> None:
    """ModelError (one line) unless the draft's tokenizer maps every token as the served model's does."""
    mine, theirs = draft_tokenizer.get_vocab(), tokenizer.get_vocab()
    if mine != theirs:
        differ = sum(1 for t, i in mine.items() if theirs.get(t) != i) + len(set(theirs) - set(mine))
        raise ModelError(f"--draft {name}: its tokenizer differs from the served model's ({len(mine)} tokens "
                         f"against {len(theirs)}, {differ} mapped differently); a draft model must share the "
                         "served model's vocabulary")


class DraftModel:
    """A whole model that drafts for sessions, each with its KV kept between steps."""

    def __init__(self, executor: ShardExecutor, vocab: int):
        self.executor = executor
        self.layers = executor.w.shard.num_layers
        self.vocab = vocab  # the served model's: draft logits past it (a padded lm_head) are never drafted
        self.context = getattr(executor.w.config, "max_position_embeddings", 0) or 0
        self.fed: OrderedDict[str, list[int]] = OrderedDict()  # session -> the tokens its draft KV holds

    @classmethod
    def load(cls, source: ModelSource, tokenizer, vocab: int, *, dtype: torch.dtype, device: str,
             quant: str | None, cache_root: Path | None, progress: bool) -> "DraftModel":
        """Load ``source`` whole; ModelError when its vocabulary is not ``tokenizer``'s."""
        from ..compute.models import load_config, load_shard, load_tokenizer

        check_vocabulary(load_tokenizer(source, cache_root), tokenizer, source.path.name)
        layers = load_config(source, cache_root).num_hidden_layers
        weights = load_shard(source, Shard(0, layers - 1, layers), dtype=dtype, device=device, progress=progress,
                             cache_root=cache_root, quant=quant)
        log.info("drafting with %s (%d layers)", source.model_id, layers)
        model = cls(ShardExecutor(weights, KVStore()), vocab)
        model.warm_up()
        return model

    def warm_up(self) -> None:
        """Run the model once on two tokens, so that what its first pass does once (building a
        kernel for this machine, the first allocations: a second or more) is done at load, not
        in a request's first step, whose time teaches the head what the model costs."""
        self.propose(WARM_UP, [0, 0], 2, Sampling())
        self.forget(WARM_UP)

    def propose(self, session: str, history: list[int], k: int,
                sampling: Sampling) -> tuple[list[int], list[DraftDist]]:
        """Up to ``k`` drafts to follow ``history``, and (a sampling request) the DraftDist each was
        drawn from; ([], []) where the draft model's context has no room."""
        k = min(k, self.context - len(history) - 1) if self.context else k
        if k <= 0:
            return [], []
        logits = self._catch_up(session, history)  # (vocab,)
        drafts, dists = [], []
        for i in range(k):
            if sampling.temperature == 0.0:
                drafts.append(int(torch.argmax(logits)))
            else:
                token, q = propose(logits, sampling, len(history) + i, MAX_DRAFT_Q)
                drafts.append(token)
                dists.append(q)
            if i + 1 < k:
                logits = self._feed(session, drafts[-1:])
        return drafts, dists

    def bind(self, session: str, sampling: Sampling) -> "SessionDrafter":
        """The draft model as one session's drafter (speculation.Drafter)."""
        return SessionDrafter(self, session, sampling)

    def forget(self, session: str) -> None:
        """The session ended: its draft KV goes."""
        self.fed.pop(session, None)
        self.executor.kv.drop(session)

    def _catch_up(self, session: str, history: list[int]) -> torch.Tensor:
        """Feed what ``history`` adds to what the session's draft KV holds, cutting rejected
        drafts off first; the logits (vocab,) of the position after it."""
        fed = self.fed.get(session, [])
        same = next((i for i, (a, b) in enumerate(zip(fed, history)) if a != b), min(len(fed), len(history)))
        same = min(same, len(history) - 1)  # at least the last token runs: its logits are the first draft's
        kv = self.executor.kv.get(session)
        if kv is not None and 0 < same < kv.length:
            self.executor.roll_back(kv, same)  # in place; a layer that cannot be cut: a cache miss below
        self.fed[session] = history[:same]
        self.fed.move_to_end(session)
        while len(self.fed) > MAX_DRAFT_SESSIONS:
            self.forget(next(iter(self.fed)))
        try:
            return self._feed(session, history[same:])
        except CacheMissError:  # the KV went (idle, evicted): feed the whole history
            self.fed[session] = []
            return self._feed(session, history)

    def _feed(self, session: str, ids: list[int]) -> torch.Tensor:
        """Run ``ids`` after what the session's draft KV holds; the logits (vocab,) after the last."""
        fed = self.fed[session]
        result = self.executor.run(session, 0, self.layers - 1, torch.tensor([ids], dtype=torch.int64), len(fed))
        fed.extend(ids)
        return result.logits[:self.vocab] if self.vocab else result.logits  # (vocab,)


@dataclass
class SessionDrafter:
    """A DraftModel bound to one session and the way it samples (its seed included)."""

    model: DraftModel
    session: str
    sampling: Sampling

    def propose(self, history: list[int], k: int) -> tuple[list[int], list]:
        return self.model.propose(self.session, history, k, self.sampling)

    def close(self) -> None:
        self.model.forget(self.session)
