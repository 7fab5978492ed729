"""Structured output: a grammar's token mask, computed where the token is sampled (the tail).

The engine is llguidance (README, "Structured output", says why it over xgrammar). A
``protocol.Grammar`` (a JSON schema, any JSON object, a regex or a Lark grammar) becomes
llguidance's grammar text (``to_llguidance``); the head and the web UI check it with
``problem`` before it travels, without a tokenizer. The tail compiles it once per digest
against its tokenizer (``Grammars``: a pristine matcher per grammar, copied per session) and
keeps a ``Matcher`` per session, which masks the logits before each draw and advances with
the token drawn. Once the grammar is complete only end-of-sequence is allowed, so the head
ends the reply as at any end-of-sequence token (finish_reason "stop").
No sockets here.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np
import torch

from ..wire.protocol import Grammar
from .grammar_text import GrammarError, digest, problem, to_llguidance

__all__ = ["Grammars", "Matcher", "GrammarError", "digest", "problem", "to_llguidance"]

MAX_COMPILED = 64  # grammars the tail keeps compiled (by digest); beyond it the least recently used goes


class Matcher:
    """One session's place in its grammar: masks logits, then advances with the token drawn."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self._m = matcher
        self.vocab = vocab
        self._bits = llnp.allocate_token_bitmask(1, vocab)  # (1, ceil(vocab / 32)) int32

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next."""
        llnp.fill_next_token_bitmask(self._m, self._bits, 0)
        if self._m.is_error():
            raise GrammarError(f"the grammar allows no token: {self._m.get_error()}")
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].view(bool)

    def mask(self, logits: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """``logits`` (vocab,) with every token the grammar forbids at -inf; in place when
        ``owned`` (a copy the caller made), else as a float32 copy."""
        allowed = self.allowed()  # (vocab,)
        out = logits if owned else logits.float()
        if out.device.type == "cpu":
            arr = out.numpy() if owned else out.numpy().copy()  # numpy: this thread, not torch's pool
            arr[: self.vocab][~allowed] = -np.inf
            arr[self.vocab:] = -np.inf
            return torch.from_numpy(arr)
        out = out if owned else out.clone()
        out[: self.vocab].masked_fill_(torch.from_numpy(~allowed).to(out.device), float("-inf"))
        out[self.vocab:] = float("-inf")
        return out

    def advance(self, token: int) -> None:
        """Take ``token`` as the next of the reply. After the grammar ended (only end-of-sequence
        was allowed) tokens change nothing: a request that ignores end-of-sequence goes on."""
        if self._m.is_stopped():
            return
        if not self._m.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: {self._m.get_error()}")

    def advance_all(self, tokens) -> None:
        for token in tokens:
            self.advance(token)

    @property
    def done(self) -> bool:
        return self._m.is_stopped()


class Grammars:
    """The tail's compiled grammars: a pristine matcher per digest (compiling a schema costs
    milliseconds; copying its matcher, microseconds). The tokenizer's llguidance form costs
    about a second for a 49K vocabulary, so it is built on the first constrained session, not
    by every node at start-up."""

    def __init__(self, tokenizer: Callable[[], object], vocab: int, eos: Callable[[object], list[int]],
                 bound: int = MAX_COMPILED):
        self._load = tokenizer  # () -> the model's Hugging Face tokenizer
        self._eos = eos  # tokenizer -> its end-of-sequence ids (the head's set)
        self.vocab = vocab  # the logits' width (may exceed the tokenizer's)
        self.bound = bound
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: Grammar) -> Matcher:
        """A fresh matcher for ``grammar``, advanced past ``grammar.generated``."""
        key = digest(grammar)
        with self._lock:
            pristine = self._compiled.get(key)
            if pristine is None:
                pristine = self._compile(grammar)
                self._compiled[key] = pristine
                if len(self._compiled) > self.bound:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        m = Matcher(pristine.deep_copy(), self.vocab)
        m.advance_all(grammar.generated)
        return m

    def _compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            hf = self._load()
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab, eos_token=self._eos(hf))
        matcher = llguidance.LLMatcher(self._tokenizer, to_llguidance(grammar))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher
