"""Every family and every common GGUF type, split over nodes' shards, against transformers.

Tiny random models are written as GGUF files (tests/gguf_models.py) in each family and
tensor type, each type on llama and on more families, each family on several types (not the
whole cross: ``EXACT_CASES``, ``DEFAULT_CASES``), then:

- exact mode (``--quant none``, float32): two shards chained in process give the greedy
  tokens of transformers' own float32 load of the same file, prefilled in chunks as a head
  slices a prompt (a float32 comparison in another order: the reference's tokens must lead
  clearly, tests/tiny_models.py);
- the default mode (``--quant auto``, each type on its own kernel): the split gives the
  tokens of one transformers process holding the very same quantized weights, prefilled in
  the same chunks (bfloat16 runs compare only when they compute in the same order), and
  each type sits on the kernel the README says;
- memory: a shard's weights against its share of the file, by type.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from fabric.compute.gguf_load import EMBED_TENSOR, GGUFTensors, dequantize, wanted
from fabric.compute.model_ref import BLOCK_TYPES, GRID_TYPES, INT8_TYPES, pick_quant
from fabric.compute.models import load_shard, resolve
from fabric.compute.quant import file_on_dot
from fabric.wire.shard import Shard
from tests.gguf_models import FAMILIES_GGUF, TYPES, q4_k_m_mix, write_gguf
from tests.test_quant import reference_tokens, split_tokens
from tests.tiny_models import assert_clear_lead

PROMPT = [1, 5, 17, 33, 60, 8, 101, 44, 9, 250, 12, 7, 77, 140, 3, 61, 99, 18, 230, 45]  # past gemma's window of 8
SPARE_PROMPTS = ([1, 40, 2, 90, 31, 7, 200, 15, 66, 4, 18, 130, 57, 9, 211, 3, 8, 150, 27, 72],
                 [1, 300, 22, 6, 48, 190, 11, 85, 2, 61, 240, 36, 5, 170, 13, 99, 42, 7, 260, 30])
NEW_TOKENS = 8
CHUNK = 6  # prefill slices, as a head cuts a long prompt
DEFAULT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "Q2_K", "IQ4_XS", "mix")
# a shard's weights in memory against its share of the file, at most (README, "Which GGUF types run how")
MEMORY_CEILING = {"Q4_0": 1.25, "Q4_1": 1.25, "Q4_K": 1.2, "Q6_K": 1.25, "Q8_0": 1.0, "mix": 1.25, "F16": 1.0,
                  "Q5_0": 1.1, "Q5_1": 1.1, "Q5_K": 1.1}  # Q5_*: the file's own blocks (fabric.compute.qblock)
# Q4_K: the q8dot kernel keeps the file's 6-bit multipliers (as float16) and its super-blocks' d and
# dmin, 20.5 bytes per 32 weights against the file's 18; as float32 steps and minima (1.33x) it fails


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    made: dict[tuple[str, str], Path] = {}

    def make(family: str, kind: str) -> Path:
        if (family, kind) not in made:
            directory = tmp_path_factory.mktemp(f"{family}-{kind}")
            made[family, kind] = write_gguf(family, directory, q4_k_m_mix if kind == "mix" else kind)
        return made[family, kind]
    return make


def float32_greedy(path: Path, n: int) -> tuple[list[int], list[int]]:
    """(prompt, greedy tokens) of transformers' own float32 load of the file: the first of the
    prompts whose every token leads clearly (a near-tie is refused, never compared)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for prompt in (PROMPT, *SPARE_PROMPTS):
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids),
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        try:
            assert_clear_lead(torch.stack(out.scores)[:, 0])
        except AssertionError:
            continue
        return prompt, out.sequences[0, len(prompt):].tolist()
    pytest.fail(f"every prompt meets a near-tie on {path}: add another prompt")


# Exact mode's cases: every type on llama (whose q and k rows a GGUF file stores permuted) and
# on at least one more family, every family on at least four types; the K-quants on gemma3 and
# qwen3_moe (a 3-D expert tensor per layer). A type's dequantization does not depend on the
# family, nor a family's tensor names on the type: the whole cross (105 cases) took 130 s.
OTHER_TYPES = {
    "qwen2": ("F16", "Q4_1", "Q5_K", "IQ4_NL"),
    "qwen3": ("BF16", "Q5_0", "Q6_K", "IQ4_XS"),
    "phi3": ("F32", "Q4_0", "Q8_0", "Q3_K"),
    "gemma2": ("F16", "Q5_1", "Q4_K", "Q2_K"),
    "gemma3": ("Q5_0", "Q4_K", "Q6_K", "Q2_K", "IQ4_XS"),
    "qwen3_moe": ("Q8_0", "Q4_K", "Q5_K", "Q3_K", "IQ4_NL"),
}
EXACT_CASES = [("llama", kind) for kind in TYPES] + [(f, kind) for f, kinds in OTHER_TYPES.items() for kind in kinds]


def test_exact_modes_cases_cover_every_family_and_type():
    families = Counter(family for family, _ in EXACT_CASES)
    on = {kind: {family for family, k in EXACT_CASES if k == kind} for kind in TYPES}
    assert set(families) == set(FAMILIES_GGUF) and min(families.values()) >= 4
    assert all(len(fams) >= 2 and "llama" in fams for fams in on.values()), on
    assert len(set(EXACT_CASES)) == len(EXACT_CASES)


@pytest.mark.parametrize("family,kind", EXACT_CASES)
def test_exact_split_gives_transformers_float32_tokens(gguf_file, family, kind):
    path = gguf_file(family, kind)
    prompt, expected = float32_greedy(path, NEW_TOKENS)
    assert split_tokens(path, 2, prompt, NEW_TOKENS, chunk=CHUNK, scheme=None) == expected


DEFAULT_CASES = ([("llama", kind) for kind in DEFAULT_TYPES]
                 + [("gemma3", kind) for kind in ("Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "mix")]
                 + [(family, kind) for family in FAMILIES_GGUF if family not in ("llama", "gemma3")
                    for kind in ("Q4_0", "Q5_K", "mix")])


@pytest.mark.parametrize("family,kind", DEFAULT_CASES)
def test_default_split_gives_the_single_process_tokens_on_the_same_kernels(gguf_file, family, kind):
    path = gguf_file(family, kind)
    scheme, why = pick_quant("auto", resolve(str(path)))
    assert scheme is not None, why
    expected = reference_tokens(path.parent, PROMPT, NEW_TOKENS, scheme, chunk=CHUNK, gguf_file=path.name)
    assert split_tokens(path, 2, PROMPT, NEW_TOKENS, chunk=CHUNK, scheme=scheme) == expected


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "Q3_K", "mix"])
def test_each_type_sits_on_its_own_kernel(gguf_file, kind):
    """Q4_* on the q8dot kernel (or torch's int4) with the file's codes, Q5_* on the qmatmul kernel
    with the file's blocks, Q6_K/Q8_0 on int8 rows (q8dot, or torch's int8), the rest in bfloat16."""
    path = gguf_file("llama", kind)
    source = resolve(str(path))
    scheme, _ = pick_quant("auto", source)
    weights = load_shard(source, Shard(0, 3, 4), quant=scheme, progress=False)
    kernels = Counter(type(m).__name__ for layer in weights.layers.values() for m in layer.modules()
                      if "Linear" in type(m).__name__)
    types = {"mix": ("Q4_K", "Q6_K")}.get(kind, (kind,))
    want, dot = set(), file_on_dot(scheme)  # a GGUF's default mode: 4-bit grids and int8 rows on q8dot
    for t in types:
        want.add(("DotLinear" if dot else "Int4Linear") if t in GRID_TYPES else "BlockLinear" if t in BLOCK_TYPES
                 else ("DotLinear" if dot else "Int8Linear") if t in INT8_TYPES else "Linear")
    assert set(kernels) == want, kernels
    if "Linear" in want:
        assert all(m.weight.dtype == torch.bfloat16 for layer in weights.layers.values() for m in layer.modules()
                   if type(m) is torch.nn.Linear)


def _share_of_file(path: Path, shard: Shard, tied: bool, lazy_embed: bool) -> int:
    """Bytes of the file's tensors a shard holds in memory (a lazily read embedding stays in the file)."""
    tensors = GGUFTensors.open(path)
    return sum(t.nbytes for t in tensors.infos if wanted(t.name, shard, tied)
               and not (lazy_embed and t.name == EMBED_TENSOR and not (shard.is_last and tied)))


@pytest.mark.parametrize("kind", sorted(MEMORY_CEILING))
def test_a_shards_weights_stay_near_its_share_of_the_file(gguf_file, kind):
    path = gguf_file("llama", kind)
    source = resolve(str(path))
    scheme, _ = pick_quant("auto", source)
    for shard in (Shard(0, 1, 4), Shard(2, 3, 4)):
        weights = load_shard(source, shard, quant=scheme, progress=False)
        lazy = shard.is_first and type(weights.embed).__name__ == "GGUFEmbedding"
        ratio = weights.parameter_bytes() / _share_of_file(path, shard, tied=False, lazy_embed=lazy)
        assert ratio <= MEMORY_CEILING[kind], f"{kind} {shard}: {ratio:.2f}x the file"


def _mapped(path: Path) -> int:
    """How many mappings of ``path`` this process has (/proc/self/maps)."""
    return sum(1 for line in open("/proc/self/maps") if line.rstrip().endswith(str(path)))


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_0"])
def test_a_heads_embedding_reads_its_rows_without_mapping_the_file(gguf_file, kind):
    """Every page of a map a lookup touches (and the pages read around it) would stay resident:
    the rows are read, and equal the whole embedding's, repeated and in any order."""
    path = gguf_file("llama", kind)
    head = load_shard(resolve(str(path)), Shard(0, 1, 4), progress=False)
    assert type(head.embed).__name__ == "GGUFEmbedding"
    tensors = GGUFTensors.open(path)
    info = tensors.find(EMBED_TENSOR)
    whole = torch.from_numpy(dequantize(tensors.raw(info), info.tensor_type))  # (vocab, hidden)
    tensors.close()
    vocab = whole.shape[0]
    ids = torch.cat([torch.arange(vocab).flip(0), torch.tensor([5, 5, 0, vocab - 1])]).reshape(2, -1)
    assert torch.equal(head.embed(ids), whole[ids])  # bit for bit
    assert _mapped(path) == 0
    with pytest.raises(IndexError):
        head.embed(torch.tensor([[vocab]]))


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_a_heads_embedding_keeps_the_rows_it_read_within_its_bound(gguf_file, monkeypatch, kind):
    """Rows looked up again come from what the embedding kept, not the file; past the bound the
    oldest go and are read again: the rows equal the whole embedding's either way."""
    from fabric.compute import gguf_load

    path = gguf_file("llama", kind)
    embed = load_shard(resolve(str(path)), Shard(0, 1, 4), progress=False).embed
    tensors = GGUFTensors.open(path)
    info = tensors.find(EMBED_TENSOR)
    whole = torch.from_numpy(dequantize(tensors.raw(info), info.tensor_type))
    tensors.close()
    read = []
    rows_of = embed.tensors.rows_of
    monkeypatch.setattr(embed.tensors, "rows_of", lambda info, ids: read.append(ids.tolist()) or rows_of(info, ids))
    ids = torch.tensor([[7, 5, 7, 9]])  # (rows 0-3 were read as the head loaded: its probe)
    assert torch.equal(embed(ids), whole[ids]) and read == [[7, 5, 9]]
    assert torch.equal(embed(torch.tensor([[9, 5]])), whole[torch.tensor([[9, 5]])]) and len(read) == 1  # kept: no read
    monkeypatch.setattr(gguf_load, "KEPT_ROW_BYTES", 2 * whole[0].numel() * 4)  # two rows at most
    assert torch.equal(embed(torch.tensor([[11, 12, 13]])), whole[torch.tensor([[11, 12, 13]])])
    assert list(embed._kept) == [12, 13] and embed._kept_bytes == 2 * whole[0].numel() * 4
    assert torch.equal(embed(torch.tensor([[7]])), whole[torch.tensor([[7]])]) and read[-1] == [7]  # evicted: read again


# --------------------------------------------------------------------------- real node processes

RAW_PROMPT = "the quick brown fox jumps over the lazy dog"  # words the tiny tokenizer knows


def _prompt_ids(path: Path, cache: Path) -> list[int]:
    """The ids a head makes of RAW_PROMPT (a raw prompt, as /v1/completions sends it)."""
    from fabric.compute.models import load_tokenizer

    return load_tokenizer(resolve(str(path)), cache)(RAW_PROMPT, add_special_tokens=True)["input_ids"]


def test_a_k_quant_gemma3_file_splits_over_two_node_processes(process_cluster, gguf_file):
    """`meshnet node` twice on a Q4_K/Q6_K Gemma 3 file: exact mode gives transformers' float32
    greedy tokens; the default mode runs each type on its kernel (fingerprint ``:gguf``) and answers."""
    from tests.test_processes import token_ids

    path = gguf_file("gemma3", "mix")
    ids = _prompt_ids(path, process_cluster.cache / "meshnet")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt),
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert_clear_lead(torch.stack(out.scores)[:, 0])
    want = out.sequences[0, len(ids):].tolist()
    for mode, extra in (("exact", ("--quant", "none", "--dtype", "float32")), ("default", ())):
        names = (f"{mode}-head", f"{mode}-tail")
        process_cluster.start_node(names[0], str(path), "0-2", None, "--model-id", mode, *extra)
        process_cluster.start_node(names[1], str(path), "3-5", None, "--model-id", mode, *extra)
        status = process_cluster.wait_nodes(list(names), mode)
        prints = {n["fingerprint"] for n in status["nodes"] if n["id"] in names}
        assert len(prints) == 1 and prints.pop().endswith(":gguf" if mode == "default" else "")
        with process_cluster.client() as client:
            events = list(client.generate(mode, prompt=RAW_PROMPT, max_tokens=10, ignore_eos=True))
        got = token_ids(events)
        if mode == "exact":
            assert got == want, process_cluster.logs()
        else:
            assert len(got) == 10, process_cluster.logs()
