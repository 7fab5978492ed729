"""Run decoder layers start..end of a shard for one session, or one pass for many. No sockets here.

This follows ``LlamaModel.forward`` with the library's own pieces (embedding, rotary
embeddings, mask helpers, decoder layers, a DynamicCache whose full-attention layers grow
in place: fabric/compute/cache.py), except that lengths and mask sizes come from the first
layer this hop runs: the cache's default (layer 0) is empty on a shard that does not hold
layer 0. Sessions that decode together keep their KV as rows of one ``RowGroup``
(fabric/compute/rows.py), where their batched steps read and append to it in place.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv import KVStore, SessionKV
from .models import ShardWeights
from .rows import RowGroup

log = logging.getLogger(__name__)


class CacheMissError(Exception):
    """The session's KV is not here (evicted, restarted, or a different layer span)."""

    def __init__(self, have: int):
        super().__init__(f"session KV holds {have} tokens")
        self.have = have


@dataclass(frozen=True)
class Step:
    """One session's input for a hop: input_ids (1, q) from layer 0, else hidden (1, q, hidden)."""

    session: str
    start: int
    end: int
    inputs: torch.Tensor
    pos: int


@dataclass(frozen=True)
class StepResult:
    """What one hop produced: hidden states for the next hop, or the tail's logits."""

    hidden: torch.Tensor | None  # (1, q, hidden) when this hop is not the tail
    logits: torch.Tensor | None  # (vocab,) float32 of the last position, on the tail


class ShardExecutor:
    def __init__(self, weights: ShardWeights, kv: KVStore):
        self.w = weights
        self.kv = kv
        self.group: RowGroup | None = None  # the sessions that decode together, their KV in its rows
        config = weights.config
        types = getattr(config, "layer_types", None)
        sliding = getattr(config, "sliding_window", None) is not None
        self.layer_types = list(types) if types else [
            "sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.w.config.hidden_size

    def finish(self) -> None:
        """Return once the device has run every queued kernel. CUDA runs a hop after the
        call returns; a node times hops and holds its compute lock until this."""
        if self.w.device.type == "cuda":
            torch.cuda.synchronize(self.w.device)

    def check_span(self, start: int, end: int) -> None:
        if not self.w.shard.covers(start, end):
            raise ValueError(f"layers {start}-{end} are outside this node's shard {self.w.shard}")

    @torch.inference_mode()
    def run(self, session: str, start: int, end: int, inputs: torch.Tensor, pos: int,
            logits: bool = True, reuse: str = "") -> StepResult:
        """Run layers start..end on ``inputs`` at positions pos.. for ``session``.

        ``inputs`` is input_ids (1, q) when start is 0, else hidden states (1, q, hidden).
        pos 0 starts the session afresh (prefill, or re-prefill after a cache miss);
        ``reuse`` names an ended session whose retained KV holds the first pos positions:
        the session starts with them (``take_over``); otherwise pos must continue the
        session's cache. Else CacheMissError. ``logits`` False (a prefill chunk that more
        follow) skips the tail's norm and lm_head.
        """
        self.check_span(start, end)
        kv = self.take_over(reuse, session, start, end, pos) if reuse else self._session_kv(session, start, end, pos)
        q, tail = inputs.shape[1], end == self.w.shard.num_layers - 1
        if kv.group is not None and q == 1 and (logits or not tail):
            return self._group_pass([Step(session, start, end, inputs, pos)], [kv])[0]  # its row, in place
        if kv.group is not None:
            self._ungroup(kv)  # a chunk of several positions runs on the session's own cache
        hidden = self._embed(start, inputs)  # (1, q, hidden)
        position_ids = torch.arange(pos, pos + q, device=self.w.device).unsqueeze(0)  # (1, q)
        masks = self._masks(kv, hidden, position_ids, start, end)
        position_embeddings = self.w.rotary(hidden, position_ids)
        for i in range(start, end + 1):
            hidden = self.w.layers[i](hidden, attention_mask=masks[self.layer_types[i]],
                                      position_ids=position_ids, cache=kv.cache, use_cache=True,
                                      position_embeddings=position_embeddings)
        kv.length = pos + q
        kv.touch()
        if not logits and tail:
            return StepResult(hidden=None, logits=None)
        return self._result(hidden, end)[0]

    def _embed(self, start: int, inputs: torch.Tensor) -> torch.Tensor:
        if start == 0:
            return self.w.embed(inputs.to(self.w.device))  # (b, q, hidden)
        return inputs.to(device=self.w.device, dtype=self.w.dtype)  # (b, q, hidden)

    def _result(self, hidden: torch.Tensor, end: int) -> list[StepResult]:
        """One StepResult per row of ``hidden`` (b, q, hidden): hidden states, or on the tail
        the logits of each row's last position."""
        if end != self.w.shard.num_layers - 1:
            return [StepResult(hidden=h.unsqueeze(0), logits=None) for h in hidden]
        logits = self.w.lm_head(self.w.norm(hidden[:, -1:, :]))[:, -1].float()  # (b, vocab)
        return [StepResult(hidden=None, logits=row) for row in logits]

    def batchable(self, start: int, end: int) -> bool:
        """Decode steps over start..end can run as one batch (full attention everywhere)."""
        return all(self.layer_types[i] == "full_attention" for i in range(start, end + 1))

    @torch.inference_mode()
    def run_batch(self, steps: list[Step]) -> list[StepResult | CacheMissError]:
        """One forward pass for decode steps (q = 1) of different sessions over the same
        layers, reading and appending to their rows of the batch group in place (a session
        not in it yet joins it first). Steps whose session cannot continue get a
        CacheMissError instead."""
        start, end = steps[0].start, steps[0].end
        results: list[StepResult | CacheMissError] = []
        ready: list[tuple[int, Step, SessionKV]] = []
        for n, step in enumerate(steps):
            assert (step.start, step.end) == (start, end) and step.inputs.shape[1] == 1 and step.pos > 0
            try:
                ready.append((n, step, self._session_kv(step.session, start, end, step.pos)))
                results.append(None)
            except CacheMissError as miss:
                results.append(miss)
        if ready:
            rows = self._group_pass([s for _, s, _ in ready], [kv for _, _, kv in ready])
            for (n, _, _), row in zip(ready, rows):
                results[n] = row
        return results

    @torch.inference_mode()
    def run_prefills(self, steps: list[Step]) -> list[StepResult]:
        """One forward pass for whole prompts (pos 0) of different sessions over the same
        layers: left-padded into one batch, the padding masked out. The sessions join the
        batch group, ready to decode together."""
        start, end = steps[0].start, steps[0].end
        assert all((s.start, s.end) == (start, end) and s.pos == 0 for s in steps) and self.batchable(start, end)
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
        mask = self._left_padded_mask(pads, longest, longest, hidden.dtype)
        cache = self._new_cache()
        position_embeddings = self.w.rotary(hidden, position_ids)
        for i in range(start, end + 1):
            hidden = self.w.layers[i](hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                                      use_cache=True, position_embeddings=position_embeddings)
        kvs = [self._session_kv(step.session, start, end, 0) for step in steps]  # first: a former row goes
        group = self._group_for(start, end)
        for row, (step, kv, n, pad) in enumerate(zip(steps, kvs, lengths, pads)):
            kv.length = n
            self._join(group, step.session, kv, {i: (cache.layers[i].keys[row:row + 1, :, pad:],
                                                     cache.layers[i].values[row:row + 1, :, pad:])
                                                 for i in range(start, end + 1)})
            kv.touch()
        if end == self.w.shard.num_layers - 1:
            return self._result(hidden, end)  # every row's last position is real
        return [StepResult(hidden=hidden[row:row + 1, pad:], logits=None) for row, pad in enumerate(pads)]

    def _left_padded_mask(self, pads: list[int], q: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (b, 1, q, k) for ``q`` queries ending at the last of ``k`` keys: causal,
        and no query sees its row's left padding. Finite, not -inf, so no softmax row (a
        padding query's, whose output is never used) is all -inf."""
        keys = torch.arange(k, device=self.w.device)
        causal = keys[None, :] <= torch.arange(k - q, k, device=self.w.device)[:, None]  # (q, k)
        keep = causal & (keys >= torch.tensor(pads, device=self.w.device)[:, None, None])  # (b, q, k)
        return torch.zeros(keep.shape, dtype=dtype, device=self.w.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None]

    # -- the batch group ------------------------------------------------------------------

    def _group_pass(self, steps: list[Step], kvs: list[SessionKV]) -> list[StepResult]:
        """One forward pass for decode steps over their rows of the batch group, in place:
        the rows lo..hi that hold them, a row in between with no step here running as a
        masked dummy. A session not in the group joins it first."""
        start, end = steps[0].start, steps[0].end
        group = self._group_for(start, end)
        for step, kv in zip(steps, kvs):
            if kv.group is not group:
                self._join(group, step.session, kv)
        rows = [kv.row for kv in kvs]
        lo, hi = min(rows), max(rows) + 1
        at = [r - lo for r in rows]
        inputs = torch.zeros((hi - lo, 1, *steps[0].inputs.shape[2:]), dtype=steps[0].inputs.dtype)
        inputs[at] = torch.cat([s.inputs for s in steps])  # (rows, 1) ids or (rows, 1, hidden)
        hidden = self._embed(start, inputs)
        position_ids = torch.zeros((hi - lo, 1), dtype=torch.long, device=self.w.device)
        position_ids[at, 0] = torch.tensor([s.pos for s in steps], device=self.w.device)
        cache = group.step_cache(lo, hi)  # first: it may pack the rows, which changes the mask
        mask = group.mask(lo, hi, hidden.dtype)
        position_embeddings = self.w.rotary(hidden, position_ids)
        for i in range(start, end + 1):
            hidden = self.w.layers[i](hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                                      use_cache=True, position_embeddings=position_embeddings)
        group.advance(rows)
        for kv in kvs:
            kv.length += 1
            kv.touch()
        return self._result(hidden[at], end)

    def _group_for(self, start: int, end: int) -> RowGroup:
        """The batch group over start..end, rows whose session is gone freed. A group over
        other layers (a route that uses part of this shard) hands its rows back first."""
        group = self.group
        if group is not None and (group.start, group.end) != (start, end):
            for session in group.members():
                self._ungroup(self.kv.get(session))
            group = None
        if group is None:
            group = self.group = RowGroup(start, end)
        for row, session in enumerate(group.sessions):
            kv = self.kv.get(session) if session is not None else None
            if session is not None and (kv is None or kv.group is not group or kv.row != row):
                group.free(row)
        return group

    def _join(self, group: RowGroup, session: str, kv: SessionKV, layers: dict | None = None) -> None:
        """Move ``session``'s KV into a free row of ``group``: from its own cache, or ``layers``."""
        if layers is None:
            layers = {i: (kv.cache.layers[i].keys, kv.cache.layers[i].values) for i in range(group.start, group.end + 1)}
        kv.row = group.join(session, layers)
        kv.cache, kv.group = None, group

    def _ungroup(self, kv: SessionKV | None) -> None:
        """Move a session's KV out of its row into a cache of its own; the row is freed."""
        if kv is None or kv.group is None:
            return
        group, cache = kv.group, self._new_cache()
        for i, (keys, values) in group.take(kv.row).items():
            cache.update(keys, values, i)
        kv.cache, kv.group, kv.row = cache, None, -1
        if not group.members() and group is self.group:
            self.group = None  # nobody left: its buffers go

    # -- sessions -------------------------------------------------------------------------

    def _new_cache(self):
        from .cache import new_cache

        return new_cache(self.w.config)

    def reusable(self, start: int, end: int) -> bool:
        """A session's KV over start..end can be cut to a prefix: full attention everywhere
        (a sliding window layer's cache has already dropped its oldest positions)."""
        return self.batchable(start, end)

    @torch.inference_mode()
    def retain(self, session: str) -> list[str]:
        """``session`` ended here: keep its KV for a later session that shares its prefix
        (within the store's budget, on a span that can be cut), else free it. Returns the
        kept sessions evicted to make room."""
        from .cache import trim

        kv = self.kv.get(session)
        if kv is None or not self.reusable(kv.start, kv.end) or self.kv.retained.budget <= 0:
            self.forget(session)
            self.kv.drop(session)
            return []
        self._ungroup(kv)  # a row of the batch group comes out as a cache of its own
        trim(kv.cache)  # kept, not appended to: no room to spare
        return self.kv.retain(session)

    def take_over(self, reuse: str, session: str, start: int, end: int, pos: int) -> SessionKV:
        """Start ``session`` with the first ``pos`` positions of the KV kept for ``reuse``: the
        entry itself when it holds exactly pos (the new session continues all of it), else a
        copy of its prefix, the entry staying for others. CacheMissError when no entry holds
        that much over this span."""
        retained = self.kv.retained
        old = retained.peek(reuse)
        if old is None or old.length < pos or (old.start, old.end) != (start, end):
            retained.stats["misses"] += 1
            raise CacheMissError(0)
        if old.length == pos:
            retained.pop(reuse)
            cache = old.cache
        else:
            cache = self._prefix(old.cache, start, end, pos)
        kv = SessionKV(cache=cache, start=start, end=end, length=pos)
        self._put(session, kv)
        retained.stats["hits"] += 1
        retained.stats["reused_tokens"] += pos
        return kv

    def _prefix(self, cache, start: int, end: int, n: int):
        """A new cache holding copies of the first ``n`` positions of ``cache``'s layers start..end."""
        out = self._new_cache()
        for i in range(start, end + 1):
            layer = cache.layers[i]
            out.update(layer.keys[:, :, :n], layer.values[:, :, :n], i)  # copied: (1, kv_heads, n, head_dim)
        return out

    @torch.inference_mode()
    def forget(self, session: str) -> None:
        """``session`` ended here: free its row of the batch group, if it has one."""
        row = self.group.row(session) if self.group is not None else None
        if row is not None:
            self.group.free(row)
            if not self.group.members():
                self.group = None

    def _put(self, session: str, kv: SessionKV) -> None:
        """``kv`` is ``session``'s from now on; a row its former KV held is freed."""
        self.forget(session)
        self.kv.put(session, kv)

    def _session_kv(self, session: str, start: int, end: int, pos: int) -> SessionKV:
        if pos == 0:
            kv = SessionKV(cache=self._new_cache(), start=start, end=end)
            self._put(session, kv)
            return kv
        kv = self.kv.get(session)
        if kv is None or kv.length != pos or (kv.start, kv.end) != (start, end):
            raise CacheMissError(0 if kv is None else kv.length)
        return kv

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
