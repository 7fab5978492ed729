"""A decode pass in one C call (``fabric.compute.decode_pass``) gives the layer-by-layer bits.

The kernel makes the lean layers' own kernel calls from C. Each check runs the same positions
with it and with ``MESHNET_DECODE_PASS=0`` (the layers one by one, on the same weights) and
compares the logits, or a middle shard's hidden states, bit for bit: one session's steps across
a growth of its cache, a decode batch of rows of different lengths, on one thread and on two, in
llama files of Q4_1, Q4_K and Q6_K, a qwen2 file of Q4_0 (q/k/v's bias) and a qwen3 file of Q4_1
(its per-head q and k norm). Each also checks that the pass ran; a Gemma 3 file, whose layers are
not lean layers, checks that it did not.
"""
from __future__ import annotations

import pytest
import torch

from fabric.compute import decode_pass
from fabric.compute.executor import ShardExecutor, Step
from fabric.compute.kv import KVStore
from fabric.compute.model_ref import pick_quant
from fabric.compute.models import load_config, load_shard, resolve
from fabric.wire.shard import Shard
from tests.gguf_models import write_gguf
from tests.support import on_threads

STEPS = 40  # one session's steps: its cache grows on the way (fabric.compute.kv.room)


@pytest.fixture
def counted(monkeypatch):
    """How many passes the kernel ran (a None answer is not one)."""
    ran = []
    run = decode_pass.DecodePass.run

    def counting(self, *args):
        out = run(self, *args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(decode_pass.DecodePass, "run", counting)
    return ran


def _auto(file, shard: Shard | None = None) -> ShardExecutor:
    """An executor of ``file`` as a node runs it by default (``--quant auto``): every layer, or ``shard``."""
    source = resolve(str(file))
    layers = load_config(source).num_hidden_layers
    return ShardExecutor(load_shard(source, shard or Shard(0, layers - 1, layers), progress=False,
                                    quant=pick_quant("auto", source)[0]), KVStore())


def _steps(ex: ShardExecutor, tag: str) -> list[torch.Tensor]:
    """One session's prompt and STEPS greedy steps, then a decode batch of it and two shorter sessions."""
    last = ex.w.shard.num_layers - 1
    ids = torch.randint(3, ex.w.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    out = [ex.run(tag, 0, last, ids, 0).logits]
    for at in range(20, 20 + STEPS):
        out.append(ex.run(tag, 0, last, out[-1].argmax()[None, None], at).logits)
    for n, length in enumerate((5, 13)):
        ex.run(f"{tag}-{n}", 0, last, ids[:, :length], 0)
    for k in range(3):
        at = 20 + STEPS + k
        batch = ex.run_batch([Step(tag, 0, last, ids[:, k:k + 1], at), Step(f"{tag}-0", 0, last, ids[:, 5:6], 5 + k),
                              Step(f"{tag}-1", 0, last, ids[:, 13:14], 13 + k)])
        out += [r.logits for r in batch]
    return out


def _against_layers(ex: ShardExecutor, monkeypatch, threads: int) -> list[bool]:
    fast = on_threads(threads, _steps, ex, "fast")
    monkeypatch.setenv("MESHNET_DECODE_PASS", "0")
    if ex._lean is not None:
        ex._lean.passes.clear()
    slow = on_threads(threads, _steps, ex, "slow")
    return [torch.equal(a, b) for a, b in zip(fast, slow)]


@pytest.mark.parametrize("family,kind", [("llama", "Q4_1"), ("llama", "Q4_K"), ("llama", "Q6_K"),
                                         ("qwen2", "Q4_0"), ("qwen3", "Q4_1"), ("gemma3", "Q4_1")])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_pass_in_one_call_gives_the_layers_bits(tmp_path, monkeypatch, counted, family, kind, threads):
    ex = _auto(write_gguf(family, tmp_path, kind))
    same = _against_layers(ex, monkeypatch, threads)
    assert all(same) and len(same) == 1 + STEPS + 9, same
    if family != "gemma3":
        assert sum(counted) >= STEPS, counted  # the pass ran: every step once the threads are settled
    else:
        assert not any(counted)  # Gemma's layers are not the lean llama layers: the kernel never runs


def test_a_middle_shard_hands_on_the_layers_bits(tmp_path, monkeypatch, counted):
    ex = _auto(write_gguf("llama", tmp_path, "Q4_1"), Shard(1, 2, 4))
    hidden = torch.randn(1, 9, ex.w.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()

    def states(tag: str) -> list[torch.Tensor]:
        out = [ex.run(tag, 1, 2, hidden, 0).hidden]
        return out + [ex.run(tag, 1, 2, hidden[:, at:at + 1] * 0.5, 9 + at).hidden for at in range(6)]

    fast = states("fast")
    monkeypatch.setenv("MESHNET_DECODE_PASS", "0")
    ex._lean.passes.clear()
    assert all(torch.equal(a, b) for a, b in zip(fast, states("slow")))
    assert counted == [True] * 6


def test_the_comparison_can_fail(tmp_path, monkeypatch, counted):
    """The negative control: a pass whose attention scale is off by one part in a thousand."""
    ex = _auto(write_gguf("llama", tmp_path, "Q4_1"))
    built = decode_pass.DecodePass._built

    def off(self):
        made = built(self)
        for layer in made:
            layer.scale *= 1.001
        return made

    monkeypatch.setattr(decode_pass.DecodePass, "_built", off)
    same = _against_layers(ex, monkeypatch, 1)
    assert same[0] and not all(same[1:])  # the prompt runs layer by layer: the same; the steps differ
