"""The qmatmul kernel (fabric/compute/kernels/qmatmul.c, ``fabric.compute.qblock``): Q5_0, Q5_1,
Q5_K and Q8_0 linears multiplied as the file stores them.

- the weights it multiplies by are gguf-py's dequantization of the file, bit for bit;
- its products are a float64 reference's, within float32 accumulation, for odd shapes and 1..300 rows;
- a row's output is the same bits alone and in batches of 3, 8, 64, on 1 and 2 threads;
- a model of Q5_0/Q5_K/Q8_0 layers split over two shards in the default mode gives the tokens of
  one transformers process on the same kernels;
- without the kernel (``MESHNET_NATIVE=0``) the Q5_* types fall back to int8 with one warning.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from fabric.compute import gguf_grid, native, qblock
from fabric.compute.models import load_config, load_shard, pick_quant, resolve
from fabric.wire.shard import Shard
from tests.gguf_models import encode, write_gguf
from tests.support import on_threads
from tests.test_quant import reference_tokens, split_tokens

pytestmark = pytest.mark.usefixtures("split_every_call")  # kernels split even small calls by threads

SHAPES = {  # (out, in): outputs not a multiple of the kernel's tile of 8, inputs not of 256 where the type allows
    "Q5_0": [(37, 96), (8, 32), (130, 576)],
    "Q5_1": [(40, 64), (3, 160)],
    "Q5_K": [(19, 512), (9, 256)],
    "Q8_0": [(33, 160), (1, 32), (70, 640)],
}
CASES = [(kind, shape) for kind, shapes in SHAPES.items() for shape in shapes]


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    if qblock.kernel() is None:
        pytest.fail("the qmatmul kernel could not be built here: the default mode re-rounds Q5_* onto int8")


def file_tensor(kind: str, shape, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, gguf-py's float32 dequantization) of a random tensor written as ``kind``."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    raw = encode(w, kind)
    return raw, dequantize(raw, GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind,shape", CASES)
def test_the_kernel_multiplies_by_the_files_own_weights(kind, shape):
    raw, exact = file_tensor(kind, shape)
    got = qblock.file_weights(qblock.blocks_from_raw(raw, kind))
    assert torch.equal(got, torch.from_numpy(exact))
    assert not torch.equal(got, torch.from_numpy(exact).bfloat16().float())  # the file's grid is finer than bfloat16


@pytest.mark.parametrize("kind,shape", CASES)
def test_products_match_float64_within_float32_accumulation(kind, shape):
    raw, exact = file_tensor(kind, shape, seed=1)
    layer = qblock.BlockLinear(qblock.blocks_from_raw(raw, kind))
    w = torch.from_numpy(exact).double()
    for rows in (1, 2, 3, 5, 17, 64, 300):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
        want = x.double() @ w.T  # (rows, out)
        bound = 4 * shape[1] * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + 1e-30
        assert ((layer(x).double() - want).abs() <= bound).all(), rows


def test_bfloat16_rows_come_back_bfloat16_rounded_from_float32():
    raw, _ = file_tensor("Q5_0", (24, 64))
    layer = qblock.BlockLinear(qblock.blocks_from_raw(raw, "Q5_0"))
    x = torch.randn(5, 64).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, layer(x.float()).bfloat16())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_a_rows_output_is_the_same_bits_in_any_batch(kind, threads):
    shape = SHAPES[kind][-1]
    raw, _ = file_tensor(kind, shape, seed=2)
    layer = qblock.BlockLinear(qblock.blocks_from_raw(raw, kind))
    x = torch.randn(64, shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([layer(x[r:r + 1]) for r in range(64)])
        for size in (3, 8, 64):
            batched = torch.cat([layer(x[at:at + size]) for at in range(0, 64, size)])
            assert torch.equal(batched, alone), size
        assert torch.equal(layer(x[[5, 0, 63]]), alone[[5, 0, 63]])  # other rows beside it
    finally:
        torch.set_num_threads(before)


def test_a_row_is_the_same_bits_on_one_thread_and_on_two():
    raw, _ = file_tensor("Q5_K", (70, 512), seed=4)
    layer = qblock.BlockLinear(qblock.blocks_from_raw(raw, "Q5_K"))
    x = torch.randn(9, 512).bfloat16()
    assert torch.equal(on_threads(2, layer, x), on_threads(1, layer, x))


def test_rows_the_model_reorders_are_found_and_anything_else_refused():
    raw, exact = file_tensor("Q5_0", (16, 64))
    perm = np.random.default_rng(5).permutation(16)
    blocks = gguf_grid.blocks_of(exact[perm], raw, "Q5_0", lambda a: a[perm])
    assert blocks is not None and torch.equal(qblock.file_weights(blocks), torch.from_numpy(exact[perm]))
    assert gguf_grid.blocks_of(exact * 2, raw, "Q5_0", lambda a: a * 2) is None  # not a reordering
    assert gguf_grid.blocks_of(exact[perm], raw, "Q5_0", lambda a: a) is None  # rows not where it says


def q5_mix(name: str, shape) -> str:
    """Attention Q5_0, MLP Q5_K (Q5_1 where rows are no whole super-blocks), ffn_down Q8_0."""
    if len(shape) < 2:
        return "F32"
    if "attn" in name:
        return "Q5_0"
    if "ffn_down" in name:
        return "Q8_0"
    if "ffn" in name:
        return "Q5_K" if shape[-1] % 256 == 0 else "Q5_1"
    return "Q8_0"


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_a_q5_model_split_gives_the_single_process_tokens(tmp_path, family):
    path = write_gguf(family, tmp_path, q5_mix)
    source = resolve(str(path))
    scheme, why = pick_quant("auto", source)
    assert scheme == "gguf", why
    weights = load_shard(source, Shard(0, 0, load_config(source).num_hidden_layers), quant=scheme, progress=False)
    kinds = {type(m).__name__ for m in weights.layers[0].modules() if "Linear" in type(m).__name__}
    assert "BlockLinear" in kinds, kinds
    prompt = [1, 5, 17, 33, 60, 8, 101, 44, 9, 250, 12, 7, 77, 140, 3, 61, 99, 18, 230, 45]
    expected = reference_tokens(path.parent, prompt, 8, scheme, chunk=6, gguf_file=path.name)
    assert split_tokens(path, 2, prompt, 8, chunk=6, scheme=scheme) == expected


def test_without_the_kernel_q5_falls_back_to_int8_with_one_warning(tmp_path, monkeypatch, caplog):
    path = write_gguf("llama", tmp_path, "Q5_0")
    monkeypatch.setenv("MESHNET_NATIVE", "0")
    native.library.cache_clear()
    gguf_grid._warn_no_kernel.cache_clear()
    caplog.set_level(logging.WARNING)
    try:
        source = resolve(str(path))
        weights = load_shard(source, Shard(0, 1, load_config(source).num_hidden_layers), quant="gguf",
                             progress=False)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    kinds = {type(m).__name__ for layer in weights.layers.values() for m in layer.modules()
             if "Linear" in type(m).__name__}
    assert kinds == {"Int8Linear"}
    assert caplog.text.count("qmatmul kernel is not built") == 1
