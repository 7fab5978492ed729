"""Run decoder layers start..end of a shard for one session, or one pass for many. No sockets here.

This follows ``LlamaModel.forward`` with the library's own pieces (embedding, rotary
embeddings, mask helpers, decoder layers, a DynamicCache whose full-attention layers grow
in place: fabric/compute/cache.py), except that lengths and mask sizes come from the first
layer this hop runs: the cache's default (layer 0) is empty on a shard that does not hold
layer 0. Sessions that decode together keep their KV as rows of one ``RowGroup``
(fabric/compute/rows.py), where their batched steps read and append to it in place.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import attention, lean_layers
from .hopkv import CacheMissError, HopKV
from .kv import KVStore, SessionKV
from .models import ShardWeights
from .rows import RowGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One session's input for a hop: input_ids (1, q) from layer 0, else hidden (1, q, hidden)."""

    session: str
    start: int
    end: int
    inputs: torch.Tensor
    pos: int
    drafts: int = 0  # the last positions are drafted tokens to verify: the tail computes the logits of drafts + 1
    guess: bool = False  # sent ahead (FORWARD ``guess``): every position is drafted, as are the last step's


@dataclass(frozen=True)
class Chunk:
    """A prompt's positions in a mixed pass: its ``step``, whether the tail computes its
    logits (not for a chunk that more follow), and the kept KV it starts from, if any."""

    step: Step
    logits: bool = True
    reuse: str = ""


@dataclass(frozen=True)
class StepResult:
    """What one hop produced: hidden states for the next hop, or the tail's logits."""

    hidden: torch.Tensor | None  # (1, q, hidden) when this hop is not the tail
    logits: torch.Tensor | None  # (vocab,) float32 of the last position, on the tail
    verify: torch.Tensor | None = None  # (drafts + 1, vocab) float32: a verification step's last positions, on the tail


class ShardExecutor(HopKV):
    """The layers of a shard, run for one session or as one pass for many (where each
    session's KV lives: ``HopKV``)."""

    def __init__(self, weights: ShardWeights, kv: KVStore):
        config = weights.config
        types = getattr(config, "layer_types", None)
        sliding = getattr(config, "sliding_window", None) is not None
        super().__init__(config, kv, list(types) if types else [
            "sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers)
        self.w = weights
        self._rotary_per_kind = "layer_type" in inspect.signature(weights.rotary.forward).parameters
        self._softcap = getattr(config, "final_logit_softcapping", None)
        self._lean = lean_layers.build(weights)  # the layers as plain functions, where the family has them

    @property
    def hidden_size(self) -> int:
        return self.w.config.hidden_size

    def finish(self) -> None:
        """Return once the device ran every queued kernel (a node times hops and holds its lock until this)."""
        if self.w.device.type == "cuda":
            torch.cuda.synchronize(self.w.device)

    def check_span(self, start: int, end: int) -> None:
        if not self.w.shard.covers(start, end):
            raise ValueError(f"layers {start}-{end} are outside this node's shard {self.w.shard}")

    @torch.inference_mode()
    def run(self, session: str, start: int, end: int, inputs: torch.Tensor, pos: int,
            logits: bool = True, reuse: str = "", drafts: int = 0, guess: bool = False) -> StepResult:
        """Run layers start..end on ``inputs`` at positions pos.. for ``session``.

        ``inputs`` is input_ids (1, q) when start is 0, else hidden states (1, q, hidden).
        pos 0 starts the session afresh (prefill, or re-prefill after a cache miss);
        ``reuse`` names an ended session whose retained KV holds the first pos positions:
        the session starts with them (``take_over``); otherwise pos must continue the
        session's cache. Else CacheMissError. ``logits`` False (a prefill chunk that more
        follow) skips the tail's norm and lm_head. ``drafts``: the last positions are drafted
        tokens, whose logits the tail computes too (a verification step); ``guess``: the first
        is a guess too (a step sent ahead of the last one's answer).
        """
        step = Step(session, start, end, inputs, pos, drafts, guess)  # _chunk_kv checks the span
        return self._alone(self._chunk_kv(step, reuse), step, logits)

    def _alone(self, kv: SessionKV, step: Step, logits: bool) -> StepResult:
        """``run`` once the session's KV is found."""
        if kv.group is not None and step.inputs.shape[1] == 1 and (logits or not self._tail(step.end)):
            return self._group_pass([step], [kv])[0]  # a decode step of a row of the group: there, in place
        if _in_row(kv, chunk := Chunk(step, logits)):
            return self._mixed_pass([], [], [(chunk, kv)])[0]  # a verification step of a row: there too
        return self._chunk_done(kv, step, self._pass(kv, step), logits)

    def _pass(self, kv: SessionKV, step: Step) -> torch.Tensor:
        """Layers over ``step``'s positions on the session's own cache: their output (1, q, hidden)."""
        self._ungroup(kv)  # several positions run on the session's own cache
        hidden = self._embed(step.start, step.inputs)  # (1, q, hidden)
        position_ids = torch.arange(step.pos, step.pos + step.inputs.shape[1], device=self.w.device)[None]  # (1, q)
        masks = self._masks(kv, hidden, position_ids, step.start, step.end)
        return self._layers(hidden, position_ids, masks, kv.cache, step.start, step.end)

    @torch.inference_mode()
    def replay(self, session: str, start: int, end: int, inputs: torch.Tensor, logits_from: int = -1,
               pos: int = 0) -> torch.Tensor | None:
        """An audit's re-run (fabric/node/taps.py): layers start..end on ``inputs`` at positions pos..
        for ``session`` (0: a new one, else a replay's next slice; the caller drops it): hidden states
        (1, q, hidden), or on the tail the logits of positions logits_from.. ((n, vocab); -1: the
        last; None: none of them in this slice)."""
        step = Step(session, start, end, inputs, pos)
        kv = self._chunk_kv(step, "")  # the span checked
        hidden = self._pass(kv, step)  # (1, q, hidden)
        _kept(kv, step)
        if not self._tail(end):
            return hidden
        rows = hidden[0, max(logits_from - pos, 0) if logits_from >= 0 else -1:, None]  # (n, 1, hidden); none: past it
        return torch.stack([r.logits for r in self._result(rows, end)]) if len(rows) else None  # (n, vocab)

    def _chunk_kv(self, step: Step, reuse: str, row: bool = False) -> SessionKV:
        self.check_span(step.start, step.end)
        if reuse:
            return self.take_over(reuse, step.session, step.start, step.end, step.pos, row)
        return self._session_kv(step.session, step.start, step.end, step.pos)

    def _chunk_done(self, kv: SessionKV, step: Step, hidden: torch.Tensor, logits: bool) -> StepResult:
        """After a pass over ``step``'s positions (``hidden`` (1, q, hidden) their output)."""
        _kept(kv, step)
        return self._outputs(hidden, step.end, [], [(0, Chunk(step, logits))])[0]

    def _outputs(self, hidden: torch.Tensor, end: int, rows: list[int], chunks: list[tuple[int, Chunk]]) -> list[StepResult]:
        """A pass's results from its output ``hidden`` (1, n, hidden): the decode steps' at
        positions ``rows``, then each chunk's, its positions from ``at`` on. On the tail every row
        of logits the pass owes (the steps', a chunk's last position, or its drafts' and one more)
        comes from one lm_head call: a single read of its weights serves them all, and a row's
        logits are the same bits in any batch where the lm_head is batch-invariant."""
        if not self._tail(end):
            steps = self._result(hidden[0, rows, None], end) if rows else []
            return steps + [StepResult(hidden=hidden[:, at:at + c.step.inputs.shape[1]], logits=None) for at, c in chunks]
        wanted, counts = list(rows), []
        for at, chunk in chunks:
            q, n = chunk.step.inputs.shape[1], (chunk.step.drafts + 1) * chunk.logits
            wanted += range(at + q - n, at + q)
            counts.append(n)
        logits = self._result(hidden[0, wanted, None], end) if wanted else []  # one row per position
        out, taken = logits[:len(rows)], len(rows)
        for n, (_, chunk) in zip(counts, chunks):
            mine, taken = logits[taken:taken + n], taken + n
            if not mine:
                out.append(StepResult(hidden=None, logits=None))
            elif chunk.step.drafts:
                out.append(StepResult(hidden=None, logits=mine[-1].logits, verify=torch.stack([r.logits for r in mine])))
            else:
                out.append(mine[0])
        return out

    def _tail(self, end: int) -> bool:
        return end == self.w.shard.num_layers - 1

    def _embed(self, start: int, inputs: torch.Tensor) -> torch.Tensor:
        if start == 0:
            return self.w.embed(inputs.to(self.w.device))  # (b, q, hidden)
        return inputs.to(device=self.w.device, dtype=self.w.dtype)  # (b, q, hidden)

    def _layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, masks, cache, start: int,
                end: int) -> torch.Tensor:
        """Layers start..end over ``hidden`` (b, q, hidden); ``masks`` one per layer kind, or one for all."""
        position_embeddings = self._rotary(hidden, position_ids, start, end)
        if self._lean is not None and (attend := self._lean.attend()) is not None:
            return self._lean.run(hidden, position_embeddings, masks, cache, self.layer_types, start, end, attend)
        for i in range(start, end + 1):
            kind = self.layer_types[i]
            mask = masks[kind] if isinstance(masks, dict) else masks
            hidden = self.w.layers[i](hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                                      use_cache=True, position_embeddings=position_embeddings[kind])
        return hidden

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, start: int, end: int) -> dict:
        """{layer kind: (cos, sin)} for layers start..end: one table for all, or one per kind
        where the family rotates local and global layers differently (Gemma 3)."""
        kinds = {self.layer_types[i] for i in range(start, end + 1)}
        if not self._rotary_per_kind:
            table = self.w.rotary(hidden, position_ids)
            return dict.fromkeys(kinds, table)
        return {kind: self.w.rotary(hidden, position_ids, kind) for kind in kinds}

    def _result(self, hidden: torch.Tensor, end: int) -> list[StepResult]:
        """One StepResult per row of ``hidden`` (b, q, hidden): hidden states, or on the tail
        the logits of each row's last position."""
        if not self._tail(end):
            return [StepResult(hidden=h.unsqueeze(0), logits=None) for h in hidden]
        logits = self.w.lm_head(self.w.norm(hidden[:, -1:, :]))[:, -1]  # (b, vocab)
        if self._softcap:  # Gemma 2: cap * tanh(logits / cap), as its ForCausalLM does
            logits = torch.tanh(logits / self._softcap) * self._softcap
        logits = logits.float()
        return [StepResult(hidden=None, logits=row) for row in logits]

    @torch.inference_mode()
    def run_batch(self, steps: list[Step]) -> list[StepResult | CacheMissError]:
        """One forward pass for decode steps (q = 1) of different sessions over the same
        layers, reading and appending to their rows of the batch group in place (a session
        not in it yet joins it first). Steps whose session cannot continue get a
        CacheMissError instead."""
        results, ready = self._ready(steps)
        if ready:
            rows = self._group_pass([steps[n] for n, _ in ready], [kv for _, kv in ready])
            for (n, _), row in zip(ready, rows):
                results[n] = row
        return results

    def _ready(self, steps: list[Step]) -> tuple[list, list[tuple[int, SessionKV]]]:
        """Each decode step's session KV, or the CacheMissError of a session that cannot
        continue: (results with the misses filled in, [(index, KV)] of the others)."""
        results: list[StepResult | CacheMissError | None] = []
        ready: list[tuple[int, SessionKV]] = []
        for n, step in enumerate(steps):
            assert (step.start, step.end) == (steps[0].start, steps[0].end) and step.inputs.shape[1] == 1 and step.pos
            start, end = step.start, step.end
            try:
                ready.append((n, self._session_kv(step.session, start, end, step.pos)))
                results.append(None)
            except CacheMissError as miss:
                results.append(miss)
        return results, ready

    @torch.inference_mode()
    def run_mixed(self, steps: list[Step], chunks: list[Chunk]) -> list[StepResult | CacheMissError]:
        """Decode steps (q = 1) of different sessions and chunks of other sessions' prompts, all
        over the same layers, in one forward pass (fabric/compute/mixed.py): the weights are
        read once for all, so a chunk costs only its own tokens. A prompt's last token after
        kept KV is a decode step once its session holds that KV: it joins their rows. Returns a
        result per decode step, as ``run_batch``, then one per chunk (a CacheMissError where a
        session cannot continue)."""
        results, ready = self._ready(steps)
        kvs: list[SessionKV | CacheMissError] = []
        for chunk in chunks:
            try:
                kvs.append(self._chunk_kv(chunk.step, chunk.reuse, row=_one_more(chunk)))
            except CacheMissError as miss:
                kvs.append(miss)
        found = [n for n, kv in enumerate(kvs) if isinstance(kv, SessionKV)]
        rowed = [n for n in found if _one_more(chunks[n])]
        live = [(chunks[n], kvs[n]) for n in found if n not in rowed]
        decoding = ([steps[n] for n, _ in ready] + [chunks[n].step for n in rowed],
                    [kv for _, kv in ready] + [kvs[n] for n in rowed])
        if live and len(decoding[0]) + len(live) > 1:
            out = iter(self._mixed_pass(*decoding, live))
        else:  # nothing to run beside: each part as it would run alone
            out = iter((self._group_pass(*decoding) if decoding[0] else [])
                       + [self._alone(kv, chunk.step, chunk.logits) for chunk, kv in live])
        for n, _ in ready:
            results[n] = next(out)
        done = {n: next(out) for n in rowed}  # the pass gives the rows' results first, then the live chunks'
        done |= {n: next(out) for n in found if n not in done}
        return results + [done.get(n, kv) for n, kv in enumerate(kvs)]  # a miss: its CacheMissError

    @torch.inference_mode()
    def run_prefills(self, steps: list[Step]) -> list[StepResult]:
        """One forward pass for whole prompts (pos 0) of different sessions over the same
        layers: left-padded into one batch, the padding masked out. The sessions join the
        batch group, ready to decode together. A shard that attends with
        fabric/compute/attention.py runs them as chunks of one pass instead, each on a cache of
        its own: padding would move its keys' columns, and with them the bits."""
        start, end = steps[0].start, steps[0].end
        assert all((s.start, s.end) == (start, end) and s.pos == 0 for s in steps) and self.batchable(start, end)
        if self.w.config._attn_implementation == attention.NAME:  # left padding would move the keys' columns
            return self.run_mixed([], [Chunk(step) for step in steps])
        lengths = [s.inputs.shape[1] for s in steps]
        longest = max(lengths)
        pads = [longest - n for n in lengths]
        if start == 0:
            inputs = torch.cat([F.pad(s.inputs, (pad, 0)) for s, pad in zip(steps, pads)])  # (b, longest)
        else:
            inputs = torch.cat([F.pad(s.inputs, (0, 0, pad, 0)) for s, pad in zip(steps, pads)])  # (b, longest, h)
        hidden = self._embed(start, inputs)
        position_ids = torch.stack([torch.arange(-pad, n, device=self.w.device).clamp(min=0)
                                    for pad, n in zip(pads, lengths)])  # (b, longest)
        cache = self._new_cache()
        hidden = self._layers(hidden, position_ids, self._left_padded_mask(pads, longest, hidden.dtype), cache,
                              start, end)
        kvs = [self._session_kv(step.session, start, end, 0) for step in steps]  # first: a former row goes
        group = self._group_for(start, end)
        for row, (step, kv, n, pad) in enumerate(zip(steps, kvs, lengths, pads)):
            kv.length = n
            self._join(group, step.session, kv, {i: (cache.layers[i].keys[row:row + 1, :, pad:],
                                                     cache.layers[i].values[row:row + 1, :, pad:])
                                                 for i in range(start, end + 1)})
            kv.touch()
        if self._tail(end):
            return self._result(hidden, end)  # every row's last position is real
        return [StepResult(hidden=hidden[row:row + 1, pad:], logits=None) for row, pad in enumerate(pads)]

    def _left_padded_mask(self, pads: list[int], k: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (b, 1, k, k) for left-padded prompts: causal, and no query sees its
        row's left padding. Finite, not -inf, so no softmax row (a padding query's, whose
        output is never used) is all -inf."""
        keys = torch.arange(k, device=self.w.device)
        causal = keys[None, :] <= keys[:, None]  # (k, k)
        keep = causal & (keys >= torch.tensor(pads, device=self.w.device)[:, None, None])  # (b, k, k)
        return torch.zeros(keep.shape, dtype=dtype, device=self.w.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None]

    # -- passes over the batch group --------------------------------------------------------

    def _group_pass(self, steps: list[Step], kvs: list[SessionKV]) -> list[StepResult]:
        """One forward pass for decode steps over their rows of the batch group, in place:
        the rows lo..hi that hold them, a row in between with no step here running as a
        masked dummy. A session not in the group joins it first."""
        group, rows, lo, hi = self._rows(steps, kvs)
        hidden, position_ids = self._row_inputs(steps, rows, lo, hi)
        cache = group.step_cache(lo, hi)  # the buffers grow here if a row is full
        hidden = self._layers(hidden, position_ids, cache.mask(hidden.dtype), cache, steps[0].start,
                              steps[0].end)
        self._advance(group, rows, kvs)
        return self._result(hidden[[r - lo for r in rows]], steps[0].end)

    def _mixed_pass(self, steps: list[Step], kvs: list[SessionKV],
                    chunks: list[tuple[Chunk, SessionKV]]) -> list[StepResult]:
        """``_group_pass`` with ``chunks`` (each with its session's own cache) in the same pass,
        as one sequence: a token for each of the rows lo..hi, then each chunk's (no rows
        without steps). Results: the steps', then the chunks'."""
        from .mixed import ChunksAndRows, rows_and_chunks

        start, end = chunks[0][0].step.start, chunks[0][0].step.end
        group, rows, lo, hi = self._rows(steps, kvs) if steps else (None, [], 0, 0)
        parts, positions, masks, sizes = [], [], [], []
        if steps:
            row_hidden, row_positions = self._row_inputs(steps, rows, lo, hi)  # (n, 1, hidden), (n, 1)
            parts, positions = [row_hidden.transpose(0, 1)], [row_positions.T]
        caches = []
        for chunk, kv in chunks:
            q, pos = chunk.step.inputs.shape[1], chunk.step.pos
            parts.append(self._embed(start, chunk.step.inputs))  # (1, q, hidden)
            positions.append(torch.arange(pos, pos + q, device=self.w.device)[None])
            if _in_row(kv, chunk):  # a verification step of a row: in place, beside the decode steps
                caches.append(kv.group.chunk(kv.row, q))
                masks.append((q, caches[-1].mask()))
            else:
                self._ungroup(kv)  # its positions go to a cache of its own
                caches.append(kv.cache)
                masks.append((q, self._masks(kv, parts[-1], positions[-1], start, end)["full_attention"]))
            sizes.append(q)
        rows_cache = group.step_cache(lo, hi) if steps else None
        cache = ChunksAndRows(rows_cache, caches, sizes)
        with rows_and_chunks(self.w.config):
            hidden = self._layers(torch.cat(parts, dim=1), torch.cat(positions, dim=1),
                                  (rows_cache.mask(self.w.dtype) if steps else None, masks), cache, start, end)
        if steps:
            self._advance(group, rows, kvs)
        at, owed = hi - lo, []
        for (chunk, kv), part, q in zip(chunks, caches, sizes):
            if part is not kv.cache:
                part.done()
            _kept(kv, chunk.step)
            owed.append((at, chunk))
            at += q
        return self._outputs(hidden, end, [r - lo for r in rows], owed)

    def _row_inputs(self, steps: list[Step], rows: list[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states (hi - lo, 1, hidden) and position ids (hi - lo, 1) of rows lo..hi: each
        step's at its row, a dummy (token 0 at position 0) at a row without one."""
        at = [r - lo for r in rows]
        inputs = torch.zeros((hi - lo, 1, *steps[0].inputs.shape[2:]), dtype=steps[0].inputs.dtype)
        inputs[at] = torch.cat([s.inputs for s in steps])  # (rows, 1) ids or (rows, 1, hidden)
        position_ids = torch.zeros((hi - lo, 1), dtype=torch.long, device=self.w.device)
        position_ids[at, 0] = torch.tensor([s.pos for s in steps], device=self.w.device)
        return self._embed(steps[0].start, inputs), position_ids

    def _advance(self, group: RowGroup, rows: list[int], kvs: list[SessionKV]) -> None:
        group.advance(rows)
        for kv in kvs:
            kv.length += 1
            kv.drafted = 0
            kv.touch()

    def _masks(self, kv: SessionKV, hidden: torch.Tensor, position_ids: torch.Tensor,
               start: int, end: int) -> dict[str, torch.Tensor | None]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {}
        for i in range(start, end + 1):
            kind = self.layer_types[i]
            if kind not in masks:
                # sizes from this hop's own first layer of that kind, never layer 0
                masks[kind] = makers[kind](config=self.w.config, inputs_embeds=hidden, attention_mask=None,
                                           cache=kv.cache, position_ids=position_ids, layer_idx=i)
        return masks


def _in_row(kv: SessionKV, chunk: Chunk) -> bool:
    """A chunk that stays in its session's row of the batch group: a verification step (a decode
    step and its drafts) that continues the row. Any other chunk runs on a cache of the session's
    own (a row would widen every row of the group by its length)."""
    return kv.group is not None and chunk.step.drafts > 0 and not chunk.reuse and chunk.step.pos == kv.length


def _one_more(chunk: Chunk) -> bool:
    """A prompt's last token after the kept KV it starts from: one decode step, once the session
    holds that KV (every position gives the same bits as a row of the batch group or alone)."""
    step = chunk.step
    return bool(chunk.reuse) and chunk.logits and step.inputs.shape[1] == 1 and not step.drafts and not step.guess


def _kept(kv: SessionKV, step: Step) -> None:
    """A chunk's positions are in its session's KV now (``kv.length`` still the length before
    it). Its drafts may be cut off by the next step; so may all of a step sent ahead, and what
    the step it continues drafted."""
    q, drafted = step.inputs.shape[1], step.drafts
    if step.guess:  # every position, on top of what the step it continues drafted
        drafted = q + (kv.drafted if step.pos == kv.length else 0)
    kv.length, kv.drafted = step.pos + q, drafted
    kv.touch()
