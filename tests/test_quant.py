"""--quant int8: weight-only int8 shards give the same greedy tokens as one transformers
process running the very same quantized weights, and hold about a quarter of the bytes.

The reference prefills in the same chunks as the split: bfloat16 sums of a 4-token chunk
and of an 11-token prompt are rounded differently by some CPUs' kernels (AVX2), and the
tokens then part ways (tests/tiny_models.py says which comparisons are exact)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fabric.compute.executor import ShardExecutor
from fabric.compute.kv import KVStore
from fabric.compute.models import load_config, load_shard, resolve
from fabric.compute.quant import (
    Int4Linear,
    Int8Linear,
    quantize,
    quantize_modules,
    quantize_weight,
    quantized_layer_bytes,
)
from fabric.compute.reference import load_quantized_reference
from fabric.wire.shard import Shard, even_split
from tests.tiny_models import reference_greedy

PROMPT = [1, 5, 17, 33, 60, 8, 101, 44, 9, 250, 12]
NEW_TOKENS = 20
EOS = 2


def reference_tokens(model_dir, prompt: list[int], n: int, scheme: str = "int8",
                     chunk: int | None = None, gguf_file: str | None = None, cache_root=None) -> list[int]:
    """Greedy decode of one transformers process on the same quantized weights, prefilling
    in pieces of ``chunk`` tokens as the split does: in bfloat16, runs are bit-equal only
    when they compute in the same order (the rule in tests/tiny_models.py)."""
    model = load_quantized_reference(model_dir, gguf_file=gguf_file, scheme=scheme, cache_root=cache_root)
    return greedy_tokens(model, prompt, n, chunk)


def greedy_tokens(model, prompt: list[int], n: int, chunk: int | None = None) -> list[int]:
    """``model``'s greedy continuation of ``prompt`` (``n`` tokens at most, prefilled in pieces
    of ``chunk``), as ``reference_tokens`` decodes."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                         attention_mask=torch.ones_like(ids), prefill_chunk_size=chunk)
    return out[0, len(prompt):].tolist()


def split_tokens(model_ref, parts: int, prompt: list[int], n: int, chunk: int | None = None,
                 scheme: str = "int8", cache_root=None) -> list[int]:
    """Greedy decode through ``parts`` quantized shards chained in process (as nodes chain them)."""
    source = resolve(str(model_ref))
    layers = load_config(source, cache_root).num_hidden_layers
    executors = [ShardExecutor(load_shard(source, s, quant=scheme, progress=False, cache_root=cache_root),
                               KVStore(60)) for s in even_split(layers, parts)]
    tokens: list[int] = []
    pos, step = 0, torch.tensor([prompt])
    while len(tokens) < n:
        # prefill in chunks when asked (a tail must mask multi-token steps after the first right)
        pieces = [step[:, i:i + chunk] for i in range(0, step.shape[1], chunk)] if chunk else [step]
        for piece in pieces:
            x = piece
            for ex in executors:
                s = ex.w.shard
                result = ex.run("s", s.start, s.end, x, pos)
                x = result.hidden
            pos += piece.shape[1]
        tok = int(result.logits.argmax())
        tokens.append(tok)
        if tok == EOS:
            break
        step = torch.tensor([[tok]])
    return tokens


@pytest.mark.parametrize("family,parts,chunk,scheme", [("llama", 2, None, "int8"), ("qwen3", 2, 4, "int8"),
                                                       ("llama", 3, 3, "int8"), ("llama", 2, None, "int4"),
                                                       ("qwen3", 3, 5, "int4")])
def test_quantized_split_equals_quantized_single_process(tiny_models, family, parts, chunk, scheme):
    model_dir = tiny_models(family)
    expected = reference_tokens(model_dir, PROMPT, NEW_TOKENS, scheme, chunk)
    assert len(set(expected)) > 3, "the reference must not be a degenerate repetition"
    if family == "llama":  # the int8 weights are really in use: float32 decodes otherwise
        assert reference_greedy(model_dir, PROMPT, NEW_TOKENS) != expected
    assert split_tokens(model_dir, parts, PROMPT, NEW_TOKENS, chunk, scheme) == expected


def test_int8_linear_matches_dequantized_matmul():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    got = q(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.bfloat16
    want = x.float() @ q.dequantized().T + linear.bias.detach().bfloat16().float()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    # and the quantization itself is close to the float weight: at most half a step per entry
    w = linear.weight.detach()
    step = q.scales.float()[:, None]
    assert ((q.dequantized() - w).abs() <= step / 2 + 1e-6).all()


def test_int4_linear_matches_dequantized_matmul_and_falls_back_to_int8():
    torch.manual_seed(0)
    linear = nn.Linear(128, 48, bias=False)
    q = Int4Linear.from_linear(linear)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(q(x).float(), x.float() @ q.dequantized().T, rtol=2e-2, atol=2e-2)
    w = linear.weight.detach()
    groups = w.view(48, 4, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)  # (48, 128)
    assert ((q.dequantized() - w).abs() <= step * 0.55 + 1e-2 * w.abs().max()).all()
    # weights already on a 4-bit grid of 32-wide groups (a Q4_1 GGUF's) come back nearly exact
    codes = torch.randint(0, 16, (48, 4, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # as llama.cpp's Q4_1 makes them: each block spans its min..max
    grid = codes * groups.std(-1, keepdim=True) / 4 + groups.mean(-1, keepdim=True)
    on_grid = nn.Linear(128, 48, bias=False)
    on_grid.weight.data = grid.view(48, 128)
    err = (Int4Linear.from_linear(on_grid).dequantized() - on_grid.weight).abs().max()
    assert err < 0.01 * on_grid.weight.abs().max()
    # shapes the int4 kernel cannot take stay int8
    model = nn.Sequential(nn.Sequential(nn.Linear(128, 40), nn.Linear(40, 64)))
    layers, _ = quantize_modules(list(model), None, "int4")
    assert [type(m) for m in layers[0]] == [Int8Linear, Int8Linear]
    layers, _ = quantize_modules([nn.Sequential(nn.Linear(128, 64))], None, "int4")
    assert isinstance(layers[0][0], Int4Linear)


def test_quantize_weight_is_symmetric_per_channel():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-127.0, 3.0, 1.0]])
    q, scales = quantize_weight(w)
    assert q.dtype == torch.int8 and q.is_contiguous() and scales.dtype == torch.bfloat16
    assert q.abs().max() <= 127 and q[2, 0] == -127 and q[0, 1] == -127
    assert (q[1] == 0).all() and scales[1] > 0  # an all-zero row does not divide by zero


def test_quantized_layers_hold_a_quarter_of_float32(tiny_models):
    source = resolve(str(tiny_models("llama")))
    shard = Shard(0, 5, 6)
    full = load_shard(source, shard, dtype=torch.float32, progress=False)
    quant = load_shard(source, shard, quant="int8", progress=False)
    assert quant.dtype == torch.bfloat16
    for i in shard_layers(shard):
        linears = [m for m in full.layers[i].modules() if isinstance(m, nn.Linear)]
        int8s = [m for m in quant.layers[i].modules() if isinstance(m, Int8Linear)]
        assert len(int8s) == len(linears) > 0
        assert not [m for m in quant.layers[i].modules() if isinstance(m, nn.Linear)]
        f32 = sum(m.weight.numel() * 4 for m in linears)
        q8 = sum(p.numel() * p.element_size() for m in int8s for p in m.parameters())
        weights = sum(m.weight.numel() for m in int8s)
        scales = sum(m.scales.numel() * 2 for m in int8s)
        assert q8 == weights + scales and q8 <= f32 / 4 * 1.1
    assert isinstance(quant.lm_head, Int8Linear)
    assert quant.parameter_bytes() < 0.4 * full.parameter_bytes()
    int4 = load_shard(source, shard, quant="int4", progress=False)
    for i in shard_layers(shard):
        f32 = sum(m.weight.numel() * 4 for m in full.layers[i].modules() if isinstance(m, nn.Linear))
        q4 = [m for m in int4.layers[i].modules() if isinstance(m, Int4Linear)]
        assert len(q4) == 7
        # half a byte per weight plus a bf16 scale and zero per 32 weights: 5/32 of float32
        assert sum(p.numel() * p.element_size() for m in q4 for p in m.parameters()) == f32 * 5 // 32
    assert isinstance(int4.lm_head, Int8Linear)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_layer_bytes_predicts_a_loaded_layer(tiny_models, scheme):
    model_dir = tiny_models("qwen3")
    loaded = load_shard(resolve(str(model_dir)), Shard(2, 2, 6), quant=scheme, progress=False)
    held = sum(p.numel() * p.element_size() for p in loaded.layers[2].parameters())
    assert quantized_layer_bytes(load_config(resolve(str(model_dir))), scheme) == held


def test_tied_lm_head_gets_its_own_copy_and_embedding_stays(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import make_config, make_tokenizer

    config = make_config("llama", 2)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    make_tokenizer(tmp_path)
    source = resolve(str(tmp_path))
    tail = load_shard(source, Shard(1, 1, 2), quant="int8", progress=False)
    assert tail.embed is None and isinstance(tail.lm_head, Int8Linear)
    full = load_shard(source, Shard(0, 1, 2), quant="int8", progress=False)
    assert full.embed.weight.dtype == torch.bfloat16 and isinstance(full.lm_head, Int8Linear)
    torch.testing.assert_close(full.lm_head.dequantized(), full.embed.weight.float(), rtol=0,
                               atol=float(full.lm_head.scales.float().max()))
    reference = load_quantized_reference(tmp_path)
    assert isinstance(reference.lm_head, Int8Linear)
    assert reference.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = [1, 40, 77, 9]
    ids = torch.tensor([prompt])
    out = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
    assert isinstance(reference.lm_head, Int8Linear)  # generate did not re-tie it
    ex = ShardExecutor(full, KVStore(60))
    tokens, pos, step = [], 0, ids
    for _ in range(6):
        result = ex.run("s", 0, 1, step, pos)
        pos += step.shape[1]
        tokens.append(int(result.logits.argmax()))
        step = torch.tensor([[tokens[-1]]])
    assert tokens == out[0, len(prompt):].tolist()


def test_unknown_scheme_is_refused(tiny_models):
    with pytest.raises(ValueError, match="int8"):
        quantize(nn.Sequential(), "int3")
    w = load_shard(resolve(str(tiny_models("llama"))), Shard(0, 2, 6), quant="none", progress=False)
    assert not [m for m in w.layers[0].modules() if isinstance(m, Int8Linear)]


def shard_layers(shard: Shard) -> range:
    return range(shard.start, shard.end + 1)
