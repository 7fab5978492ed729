"""Run decoder layers start..end of a shard for one session. No sockets here.

This follows ``LlamaModel.forward`` with the library's own pieces (embedding, rotary
embeddings, mask helpers, decoder layers, DynamicCache), except that lengths and mask
sizes come from the first layer this hop runs: the cache's default (layer 0) is empty
on a shard that does not hold layer 0.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv import KVStore, SessionKV
from .models import ShardWeights

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


@dataclass
class BatchGroup:
    """Sessions that decode together, their KV kept as the rows of one left-padded cache
    between steps, so a step appends one column instead of gathering every session's
    cache into a batch and scattering it back. While a session is a row here, its own
    cache is stale; ``ShardExecutor._dissolve`` writes the rows back."""

    sessions: tuple[str, ...]
    kvs: tuple[SessionKV, ...]
    cache: object  # a DynamicCache over the group's span, (b, kv_heads, longest, head_dim) per layer
    pads: tuple[int, ...]  # left padding of each row
    start: int
    end: int

    def continues(self, steps: list["Step"], kvs: list[SessionKV]) -> bool:
        """The same sessions, in the same order, each exactly where the group left it."""
        return (tuple(s.session for s in steps) == self.sessions and (steps[0].start, steps[0].end) ==
                (self.start, self.end) and all(a is b and a.group is self for a, b in zip(kvs, self.kvs)))


@dataclass(frozen=True)
class StepResult:
    """What one hop produced: hidden states for the next hop, or the tail's logits."""

    hidden: torch.Tensor | None  # (1, q, hidden) when this hop is not the tail
    logits: torch.Tensor | None  # (vocab,) float32 of the last position, on the tail


class ShardExecutor:
    def __init__(self, weights: ShardWeights, kv: KVStore):
        self.w = weights
        self.kv = kv
        self.group: BatchGroup | None = None  # the sessions that decoded together last
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
        if kv.group is not None:
            self._dissolve()  # this session leaves its batch group: it needs its own cache back
        q = inputs.shape[1]
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
        if not logits and end == self.w.shard.num_layers - 1:
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
        layers. Each session's KV stays its own: past keys and values are left-padded into
        one batch, the padding masked out, and each row's new entry appended back to its
        session. Steps whose session cannot continue get a CacheMissError instead."""
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
            rows = self._batched_step([s for _, s, _ in ready], [kv for _, _, kv in ready], start, end)
            for (n, _, _), row in zip(ready, rows):
                results[n] = row
        return results

    @torch.inference_mode()
    def run_prefills(self, steps: list[Step]) -> list[StepResult]:
        """One forward pass for whole prompts (pos 0) of different sessions over the same
        layers: left-padded into one batch, the padding masked out. The sessions leave as a
        batch group, ready to decode together."""
        start, end = steps[0].start, steps[0].end
        assert all((s.start, s.end) == (start, end) and s.pos == 0 for s in steps) and self.batchable(start, end)
        self._dissolve()  # the group's rows may be other sessions: hand them back first
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
        from transformers import DynamicCache

        cache = DynamicCache(config=self.w.config)
        position_embeddings = self.w.rotary(hidden, position_ids)
        for i in range(start, end + 1):
            hidden = self.w.layers[i](hidden, attention_mask=mask, position_ids=position_ids, cache=cache,
                                      use_cache=True, position_embeddings=position_embeddings)
        kvs = [self._session_kv(s.session, start, end, 0) for s in steps]
        for kv, n in zip(kvs, lengths):
            kv.length = n
            kv.touch()
        self._adopt(steps, kvs, cache, pads)
        if end == self.w.shard.num_layers - 1:
            return self._result(hidden, end)  # every row's last position is real
        return [StepResult(hidden=hidden[row:row + 1, pad:], logits=None) for row, pad in enumerate(pads)]

    def _batched_step(self, steps: list[Step], kvs: list[SessionKV], start: int, end: int) -> list[StepResult]:
        if self.group is None or not self.group.continues(steps, kvs):
            self._dissolve()
            self._gather(steps, kvs)
        group = self.group
        hidden = self._embed(start, torch.cat([s.inputs for s in steps]))  # (b, 1, hidden)
        position_ids = torch.tensor([[s.pos] for s in steps], device=self.w.device)  # (b, 1)
        longest = group.cache.layers[start].keys.shape[-2]
        mask = self._left_padded_mask(group.pads, 1, longest + 1, hidden.dtype)
        position_embeddings = self.w.rotary(hidden, position_ids)
        for i in range(start, end + 1):
            hidden = self.w.layers[i](hidden, attention_mask=mask, position_ids=position_ids, cache=group.cache,
                                      use_cache=True, position_embeddings=position_embeddings)
        for kv in kvs:
            kv.length += 1
            kv.touch()
        return self._result(hidden, end)

    def _left_padded_mask(self, pads: list[int] | tuple[int, ...], q: int, k: int,
                          dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (b, 1, q, k) for ``q`` queries ending at the last of ``k`` keys: causal,
        and no query sees its row's left padding. Finite, not -inf, so no softmax row (a
        padding query's, whose output is never used) is all -inf."""
        keys = torch.arange(k, device=self.w.device)
        causal = keys[None, :] <= torch.arange(k - q, k, device=self.w.device)[:, None]  # (q, k)
        keep = causal & (keys >= torch.tensor(pads, device=self.w.device)[:, None, None])  # (b, q, k)
        return torch.zeros(keep.shape, dtype=dtype, device=self.w.device).masked_fill(
            ~keep, torch.finfo(dtype).min)[:, None]

    def _gather(self, steps: list[Step], kvs: list[SessionKV]) -> None:
        """Left-pad every session's KV into the rows of one new group cache."""
        from transformers import DynamicCache

        longest = max(kv.length for kv in kvs)
        batch = DynamicCache(config=self.w.config)
        for i in range(steps[0].start, steps[0].end + 1):
            keys = [F.pad(kv.cache.layers[i].keys, (0, 0, longest - kv.length, 0)) for kv in kvs]
            values = [F.pad(kv.cache.layers[i].values, (0, 0, longest - kv.length, 0)) for kv in kvs]
            batch.update(torch.cat(keys), torch.cat(values), i)  # (b, kv_heads, longest, head_dim)
        self._adopt(steps, kvs, batch, [longest - kv.length for kv in kvs])

    def _adopt(self, steps: list[Step], kvs: list[SessionKV], cache, pads: list[int]) -> None:
        """Make ``cache`` (one left-padded row per session) the batch group; the sessions'
        own caches are stale from now on."""
        self.group = BatchGroup(tuple(s.session for s in steps), tuple(kvs), cache, tuple(pads),
                                steps[0].start, steps[0].end)
        for kv in kvs:
            kv.cache, kv.group = None, self.group

    def reusable(self, start: int, end: int) -> bool:
        """A session's KV over start..end can be cut to a prefix: full attention everywhere
        (a sliding window layer's cache has already dropped its oldest positions)."""
        return self.batchable(start, end)

    def retain(self, session: str) -> list[str]:
        """``session`` ended here: keep its KV for a later session that shares its prefix
        (within the store's budget, on a span that can be cut), else free it. Returns the
        kept sessions evicted to make room."""
        self.forget(session)  # a batch group row goes back to the session's own cache first
        kv = self.kv.get(session)
        if kv is None or not self.reusable(kv.start, kv.end):
            self.kv.drop(session)
            return []
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
        self.kv.put(session, kv)
        retained.stats["hits"] += 1
        retained.stats["reused_tokens"] += pos
        return kv

    def _prefix(self, cache, start: int, end: int, n: int):
        """A new cache holding copies of the first ``n`` positions of ``cache``'s layers start..end."""
        from transformers import DynamicCache

        out = DynamicCache(config=self.w.config)
        for i in range(start, end + 1):
            layer = cache.layers[i]
            out.update(layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone(), i)  # (1, kv_heads, n, head_dim)
        return out

    def forget(self, session: str) -> None:
        """``session`` ended here: if it was a row of the batch group, hand the other rows
        back, so the group's cache does not outlive its sessions."""
        if self.group is not None and session in self.group.sessions:
            self._dissolve()

    def _dissolve(self) -> None:
        """Write each row of the current group back into its session's own cache."""
        from transformers import DynamicCache

        group, self.group = self.group, None
        if group is None:
            return
        for row, (session, kv, pad) in enumerate(zip(group.sessions, group.kvs, group.pads)):
            kv.group = None
            if self.kv.get(session) is not kv:
                continue  # ended, or replaced meanwhile (a fresh prefill)
            kv.cache = DynamicCache(config=self.w.config)
            for i in range(group.start, group.end + 1):
                layer = group.cache.layers[i]
                kv.cache.update(layer.keys[row:row + 1, :, pad:].clone(), layer.values[row:row + 1, :, pad:].clone(), i)

    def _session_kv(self, session: str, start: int, end: int, pos: int) -> SessionKV:
        from transformers import DynamicCache

        if pos == 0:
            kv = SessionKV(cache=DynamicCache(config=self.w.config), start=start, end=end)
            self.kv.put(session, kv)
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
