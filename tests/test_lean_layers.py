"""The default mode's lean layers give the bits transformers' modules give, in every kind of pass.

``fabric.compute.lean_layers`` runs the llama, mistral, qwen2 and qwen3 decoder layers as
plain functions with fused q/k/v and gate/up products. Its promise is that nothing changes
but the time: each check below computes the same positions with the lean layers and with
the modules (the executor's module path, ``_lean`` set to None) and compares the logits bit
for bit: prefill chunks, one-token steps, a decode batch of rows of different lengths, and
a mixed pass of decode rows beside a prompt's chunk.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fabric.compute import attention, lean_layers
from fabric.compute.executor import Chunk, ShardExecutor, Step
from fabric.compute.kv import KVStore
from fabric.compute.models import load_config, load_shard, resolve
from fabric.compute.quant import Int4Linear, Int8Linear
from fabric.wire.shard import Shard
from tests.test_invariant import smollm2

SERVED = ("llama", "qwen2", "qwen3", "mistral")


def _executor(model, quant: str | None = "int8", dtype=torch.bfloat16, cache_root: Path | None = None) -> ShardExecutor:
    source = resolve(str(model))
    layers = load_config(source, cache_root).num_hidden_layers
    return ShardExecutor(load_shard(source, Shard(0, layers - 1, layers), progress=False, quant=quant,
                                    dtype=dtype, cache_root=cache_root), KVStore())


def _passes(ex: ShardExecutor, tag: str) -> list[torch.Tensor]:
    """Logits of one session's chunks and steps, a decode batch of 3 and a mixed pass."""
    last = ex.w.shard.num_layers - 1
    ids = torch.randint(3, ex.w.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(7))
    out = [ex.run(tag, 0, last, ids[:, at:at + 29], at).logits for at in range(0, 87, 29)]
    out += [ex.run(tag, 0, last, ids[:, p:p + 1], p).logits for p in (87, 88)]
    for n, length in enumerate((4, 11)):
        ex.run(f"{tag}-{n}", 0, last, ids[:, :length], 0)
    batch = ex.run_batch([Step(tag, 0, last, ids[:, 89:90], 89), Step(f"{tag}-0", 0, last, ids[:, 4:5], 4),
                          Step(f"{tag}-1", 0, last, ids[:, 11:12], 11)])
    mixed = ex.run_mixed([Step(f"{tag}-0", 0, last, ids[:, 5:6], 5)],
                         [Chunk(Step(f"{tag}-new", 0, last, ids[:, 20:33], 0))])
    return out + [r.logits for r in batch + mixed]


def _lean_against_modules(ex: ShardExecutor) -> list[bool]:
    lean = _passes(ex, "lean")
    stack, ex._lean = ex._lean, None
    try:
        modules = _passes(ex, "modules")
    finally:
        ex._lean = stack
    return [torch.equal(a, b) for a, b in zip(lean, modules)]


@pytest.mark.parametrize("family", SERVED)
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_lean_layers_give_the_modules_bits(tiny_models, family, quant):
    ex = _executor(tiny_models(family), quant)
    assert ex._lean is not None
    same = _lean_against_modules(ex)
    assert all(same) and len(same) == 10, same


@pytest.mark.usefixtures("torchs_kernels")  # the torch modules themselves (q8dot: tests/test_q8dot.py)
def test_lean_layers_give_the_modules_bits_on_smollm2s_q4_1_file(cache_root):
    ex = _executor(smollm2(), "gguf", cache_root=cache_root)
    assert ex._lean is not None
    attn = ex.w.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    same = _lean_against_modules(ex)
    assert all(same) and len(same) == 10, same


def test_the_check_can_fail(tiny_models):
    """The negative control: a lean layer with another norm epsilon (0.01) gives other bits."""
    ex = _executor(tiny_models("llama"))
    ex._lean.layers[2].norm1.eps = 0.01
    assert not all(_lean_against_modules(ex))


def test_fused_weights_are_the_modules_weights(tiny_models):
    """q, k and v (and gate, up) read views of one fused weight: no second copy. (The tiny
    model's int4 k and v have 32 outputs, less than the int4 packing's block of 64 on an
    AVX-512 CPU: their fusion depends on the CPU, so q/k/v are checked on int8.)"""
    attn = _executor(tiny_models("qwen2"), "int8").w.layers[1].self_attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    assert isinstance(attn.q_proj, Int8Linear) and attn.q_proj.bias is not None
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    mlp = _executor(tiny_models("qwen2"), "int4").w.layers[1].mlp
    assert isinstance(mlp.gate_proj, Int4Linear)
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()


def test_a_fusion_that_changes_bits_keeps_the_parts_apart(tiny_models, monkeypatch):
    """Where a fused kernel would round a column otherwise, the parts run apart (and the
    weights stay their own)."""
    ex = _executor(tiny_models("llama"))
    attn = ex.w.layers[0].self_attn
    real = lean_layers._kernel

    def off_by_a_bit(linear):
        proj = real(linear)
        if isinstance(linear, Int8Linear) and linear.out_features == sum(
                m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj)):
            return lambda x: proj(x) * 1.01
        return proj

    monkeypatch.setattr(lean_layers, "_kernel", off_by_a_bit)
    before = attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr()
    lean_layers.LeanLayer(ex.w.layers[0], 0)
    assert (attn.q_proj.weight.data_ptr(), attn.k_proj.weight.data_ptr()) == before


def test_other_shards_keep_the_modules(tiny_models):
    assert _executor(tiny_models("qwen3_moe"))._lean is None  # another family
    assert _executor(tiny_models("llama"), None, torch.float32)._lean is None  # exact mode
    weights = load_shard(resolve(str(tiny_models("llama"))), Shard(0, 5, 6), progress=False, quant="int8")
    weights.config._attn_implementation = "sdpa"
    assert ShardExecutor(weights, KVStore())._lean is None
    assert attention.NAME != "sdpa"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lean_layers_run_the_q5_blocks_kernel_as_the_modules_do(tmp_path, family):
    """A Q5 linear (qblock.BlockLinear, the file's own blocks) is no int4, int8 or float
    linear: the lean layer calls the module, and the bits stay the modules' bits."""
    from fabric.compute.qblock import BlockLinear, kernel
    from tests.gguf_models import write_gguf
    from tests.test_qmatmul import q5_mix

    assert kernel() is not None, "the qmatmul kernel could not be built here"
    ex = _executor(write_gguf(family, tmp_path, q5_mix), "gguf")
    assert ex._lean is not None
    assert any(isinstance(m, BlockLinear) for m in ex.w.layers[0].modules())
    same = _lean_against_modules(ex)
    assert all(same) and len(same) == 10, same
