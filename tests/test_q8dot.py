"""The q8dot kernel (fabric/compute/kernels/q8dot.c, ``fabric.compute.q8dot``): rows quantized to
int8 per block of 32, integer dot products with a GGUF's 4-bit codes or with int8 codes.

- its rows' quantization is llama.cpp's q8_0 (step absmax / 127, codes rounded to nearest even);
- its products are a float64 product of the same quantized rows and the file's weights within
  float32 accumulation (tight), and the float product of the rows themselves within the rows'
  rounding (loose), for Q4_0, Q4_1, Q4_K, Q8_0 and int8 rows;
- a row's output is the same bits alone and in batches of 2..16, on 1 and 2 threads, and on the
  AVX2 and plain C builds of the same source;
- behind ``MESHNET_Q8DOT=1`` a GGUF's default mode runs on it, batch-invariant, lean layers and
  modules alike.
"""
from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from fabric.compute import q8dot
import torch.nn.functional as F

from fabric.compute.q8dot import DotLinear, DotMLP
from tests.gguf_models import encode, file_grid, write_gguf
from tests.support import on_threads
from tests.test_invariant import default_mode, differences, smollm2
from tests.test_lean_layers import _lean_against_modules

pytestmark = pytest.mark.usefixtures("split_every_call")  # kernels split even small calls by threads

KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q4_K f32", "Q8_0", "int8 rows")  # "Q4_K f32": its steps and minima as float32
SHAPES = {"Q4_K": (40, 512), "Q4_K f32": (40, 512)}  # outputs not whole tiles of 16; Q4_K's rows whole super-blocks
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    if q8dot.kernel() is None:
        pytest.fail("the q8dot kernel could not be built here")


def layer_of(kind: str, shape=None, seed: int = 0) -> tuple[DotLinear, torch.Tensor, torch.Tensor]:
    """(the kernel's linear, the float32 weight (out, in) it holds, |each block term's weight|)."""
    out, n = shape or SHAPES.get(kind, (40, 160))
    w = np.random.default_rng(seed).standard_normal((out, n)).astype(np.float32)
    if kind == "int8 rows":
        codes = torch.randint(-127, 128, (out, n), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
        scales = torch.rand(out, generator=torch.Generator().manual_seed(seed + 1)) * 0.02
        weight = codes.float() * scales[:, None]
        return DotLinear.from_int8(codes, scales), weight, weight.abs()
    if kind == "Q8_0":
        raw = encode(w, kind)
        blocks = raw.reshape(out, -1, 34)
        d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(out, n))
        weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0))
        return DotLinear.from_int8(codes, d), weight, weight.abs()
    _, grid = file_grid(w, kind.split()[0])
    if kind == "Q4_K f32":
        grid = dataclasses.replace(grid, factors=None)
    bound = grid.minimum.abs().repeat_interleave(32, 1) + grid.codes.float() * grid.scale.abs().repeat_interleave(32, 1)
    return DotLinear.from_grid(grid), grid.weight(), bound


def quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rows (rows, in) as floats, and each element's step."""
    q, d, _ = q8dot.quantized_rows(x)
    steps = d.repeat_interleave(32, 1)
    return q.double() * steps.double(), steps


def test_rows_are_quantized_as_llama_cpps_q8_0():
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[2, :32] = 0.0  # a block of zeros: step 0, codes 0
    x[3, 40] = -50.0  # an outlier: its block's codes shrink around it
    q, d, s = q8dot.quantized_rows(x)
    blocks = x.numpy().reshape(7, 3, 32)
    step = np.abs(blocks).max(-1) / np.float32(127)
    inv = np.where(step == 0, np.float32(0), np.float32(1) / np.where(step == 0, 1, step)).astype(np.float32)
    codes = np.rint(blocks * inv[..., None]).astype(np.int8)
    assert np.array_equal(d.numpy(), step) and np.array_equal(q.numpy(), codes.reshape(7, 96))
    assert np.array_equal(s.numpy(), codes.astype(np.int32).sum(-1)) and q[3, 40] == -127
    assert torch.equal(q8dot.quantized_rows(x.bfloat16())[0], q8dot.quantized_rows(x.bfloat16().float())[0])


@pytest.mark.parametrize("kind", KINDS)
def test_products_are_the_quantized_rows_times_the_files_weights(kind):
    layer, weight, term = layer_of(kind, seed=1)
    nb = weight.shape[1] // 32
    expect_kind = {"Q4_K": "int4_k", "Q4_K f32": "int4_f32", "Q8_0": "q8_0", "int8 rows": "int8_row"}.get(kind, "int4_f16")
    assert layer.kind == expect_kind
    for rows in (1, 2, 3, 5, 16, 17, 64):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        xq, steps = quantized(x)
        y = layer(x).double()
        tight = 4 * (nb + 3) * EPS * (xq.abs() @ term.double().T) + 1e-30
        assert ((y - xq @ weight.double().T).abs() <= tight).all(), rows
        rounding = (steps.double() / 2) @ weight.double().abs().T  # |x - xq| <= step / 2, element by element
        assert ((y - x.double() @ weight.double().T).abs() <= rounding + tight).all(), rows
        assert ((y - x.double() @ weight.double().T).abs() > tight).any(), rows  # the rows were quantized


def test_the_tight_check_can_fail():
    layer, weight, term = layer_of("Q4_1", seed=2)
    x = torch.randn(4, weight.shape[1])
    xq, _ = quantized(x)
    off = weight.clone()
    off[3, 70] += weight[3].abs().max()  # one weight moved
    tight = 4 * 8 * EPS * (xq.abs() @ term.double().T)
    assert ((layer(x).double() - xq @ off.double().T).abs() > tight).any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_output_is_the_same_bits_in_any_batch(kind, threads):
    layer, weight, _ = layer_of(kind, seed=3)
    x = torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([layer(x[r:r + 1]) for r in range(16)])
        for size in range(2, 17):
            batched = torch.cat([layer(x[at:at + size]) for at in range(0, 16, size)])
            assert torch.equal(batched, alone), size
        assert torch.equal(layer(x[[5, 0, 15, 9, 9]]), alone[[5, 0, 15, 9, 9]])  # other rows beside it
    finally:
        torch.set_num_threads(before)


def test_a_row_is_the_same_bits_on_one_thread_and_on_two():
    layer, weight, _ = layer_of("Q4_1", shape=(200, 256), seed=5)
    x = torch.randn(9, 256).bfloat16()
    assert torch.equal(on_threads(2, layer, x), on_threads(1, layer, x))


def _build(tmp_path, flags: list[str]) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    target = tmp_path / f"q8dot{len(flags)}.so"
    source = q8dot.native.SOURCES / "q8dot.c"
    subprocess.run([compiler, "-O3", *flags, "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-o", str(target),
                    str(source), "-lm"], check=True, capture_output=True, timeout=120)
    return q8dot.declared(ctypes.CDLL(str(target)))


@pytest.mark.parametrize("flags,path", [(["-mavx2", "-mfma", "-mf16c"], 1), ([], 0)])
def test_the_avx2_and_plain_builds_give_the_same_bits(tmp_path, flags, path):
    """Every kind, on one row (the AVX2 path's one sweep), and on 5 and 6 (rows grouped by 4, then
    a group of one and of two)."""
    other = _build(tmp_path, flags)
    assert other.meshnet_q8dot_path() == path
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 5, 6):
        x = torch.randn(rows, 512, generator=gen).bfloat16()
        for kind in KINDS:
            layer, _, _ = layer_of(kind, shape=(40, 512), seed=7)
            here = layer(x)
            layer._kernel, layer._job = other, None  # the job is built anew on the other build
            assert torch.equal(layer(x), here), (kind, rows)
            assert layer._call.func is other.meshnet_q8dot  # it ran there
        gate_up, down = mlp_of("Q4_1")
        x, h = x[:, :256].contiguous(), x[:, 256:].contiguous()
        here = DotMLP(gate_up, down)(x, h)
        for m in (gate_up, down):
            m._kernel, m._job = other, None
        assert torch.equal(DotMLP(gate_up, down)(x, h), here), rows


def test_the_avx2_and_plain_builds_quantize_odd_values_alike(tmp_path):
    """NaN, infinities, signed zeros, subnormals, halves that round to even, and the largest
    floats: the AVX2 path's lanes take the plain loop's codes, steps and sums."""
    plain, avx2 = _build(tmp_path, []), _build(tmp_path, ["-mavx2", "-mfma", "-mf16c"])
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(8))
    x[0, 3], x[1, 40], x[1, 41], x[2, 7] = float("nan"), float("inf"), float("-inf"), -0.0
    x[3, :32] = torch.tensor([1e-40, -3e-39] * 16)  # subnormals
    x[4, :32] = torch.arange(32) - 15.5  # with 127 beside them the step is 1: every code a half, rounded to even
    x[4, 31] = 127.0
    x[6, 32:] = torch.finfo(torch.float32).max * torch.sign(torch.randn(32))
    x[7, :32] = float("nan")
    x[8, :] = 0.0
    for rows in (x, x.bfloat16()):
        ours, theirs = q8dot.quantized_rows(rows, avx2), q8dot.quantized_rows(rows, plain)
        for a, b in zip(ours, theirs):
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               b.view(torch.int32) if b.dtype == torch.float32 else b)
    assert q8dot.quantized_rows(x, avx2)[0][4, :4].tolist() == [-16, -14, -14, -12]


def test_a_plain_c_build_is_said_once_as_a_warning(tmp_path, caplog):
    """Without AVX2 the kernel's plain C path is several times slower: the node says so, once."""
    plain = _build(tmp_path, [])
    q8dot._said_path.cache_clear()
    with caplog.at_level("INFO", logger="fabric.compute.q8dot"):
        for _ in range(2):
            q8dot._said_path(plain.meshnet_q8dot_path())
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "plain C" in caplog.text
    q8dot._said_path.cache_clear()


def test_q4_k_in_its_own_factors_gives_the_float32_steps_bits_in_fewer_bytes():
    """The file's d, dmin, sc and m (the kernel multiplies them out) against the steps and minima
    multiplied out as float32: the same values, so the same bits, in 0.85x the bytes."""
    own, _, _ = layer_of("Q4_K", shape=(48, 768), seed=3)
    f32, _, _ = layer_of("Q4_K f32", shape=(48, 768), seed=3)
    assert (own.kind, f32.kind) == ("int4_k", "int4_f32")
    assert own.packed.numel() <= 0.86 * f32.packed.numel()
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 768, generator=gen).bfloat16()
        assert torch.equal(own(x), f32(x)), rows
    _, grid = file_grid(np.random.default_rng(5).standard_normal((48, 768)).astype(np.float32), "Q4_K")
    d, dmin, sc, m = grid.factors
    wrong = (d, dmin, sc, np.where(m > 0, m - 1, m + 1).astype(np.uint8))  # factors that do not give the minima
    assert q8dot.pack_int4(grid.codes, grid.scale, grid.minimum, wrong)[0] == "int4_f32"


def test_parts_side_by_side_give_each_parts_bits():
    parts = [layer_of("Q4_1", shape=(out, 160), seed=out)[0] for out in (48, 16, 40)]
    fused = DotLinear.concatenated(parts)
    x = torch.randn(5, 160).bfloat16()
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], 1))
    assert DotLinear.concatenated([parts[2], parts[0]]) is None  # 40 outputs: not whole tiles
    assert DotLinear.concatenated([parts[0], layer_of("Q4_K", shape=(16, 256))[0]]) is None


def mlp_of(kind: str, hidden: int = 256, inner: int = 256) -> tuple[DotLinear, DotLinear]:
    gate, up = (layer_of(kind, shape=(inner, hidden), seed=seed)[0] for seed in (1, 2))
    return DotLinear.concatenated([gate, up]), layer_of(kind, shape=(hidden, inner), seed=3)[0]


def mlp_by_operators(gate_up: DotLinear, down: DotLinear, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A lean layer's MLP operator by operator (``LeanLayer._mlp``)."""
    g = gate_up(x)
    return down(F.silu(g[:, :down.in_features]).mul_(g[:, down.in_features:])).add_(h)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_mlp_in_one_call_gives_its_operators_bits(kind, threads):
    gate_up, down = mlp_of(kind)
    fused = DotMLP(gate_up, down)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 8):
        x, h = (torch.randn(rows, 256, generator=gen).bfloat16() for _ in range(2))
        want = on_threads(threads, mlp_by_operators, gate_up, down, x, h)
        assert torch.equal(on_threads(threads, fused, x, h), want), rows


def test_the_mlp_check_can_fail():
    """The negative control: a silu table one unit off in its last bit gives other bits."""
    gate_up, down = mlp_of("Q4_1")
    fused = DotMLP(gate_up, down)
    x, h = (torch.randn(4, 256, generator=torch.Generator().manual_seed(seed)).bfloat16() for seed in (5, 6))
    want = mlp_by_operators(gate_up, down, x, h)
    assert torch.equal(fused(x, h), want)
    fused.table = (q8dot.silu_table().view(torch.int16) + 1).view(torch.bfloat16)
    assert not torch.equal(fused(x, h), want)
    assert not DotMLP.fits(gate_up, layer_of("Q4_1", shape=(256, 160))[0])  # down's inputs are not gate's outputs


def after_by_operators(o: DotLinear, norm, gate_up: DotLinear, down: DotLinear, a: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
    """What follows a lean layer's attention, operator by operator (``LeanLayer._after_attention``)."""
    h = o(a).add_(x)
    return mlp_by_operators(gate_up, down, norm(h), h)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_o_proj_the_norm_and_the_mlp_in_one_call_give_their_operators_bits(kind, threads):
    from fabric.compute.lean_ops import Norm

    gate_up, down = mlp_of(kind)
    o = layer_of(kind, shape=(256, 512), seed=8)[0]
    norm = Norm(torch.randn(256, generator=torch.Generator().manual_seed(9)).bfloat16(), 1e-5)
    if norm.kernel is None:
        pytest.skip("the norm's C kernel does not give torch's bits here: the MLP's call alone is used")
    fused = DotMLP(gate_up, down).after(o, norm)
    gen = torch.Generator().manual_seed(10)
    for rows in (1, 3, 8):
        a, x = torch.randn(rows, 512, generator=gen).bfloat16(), torch.randn(rows, 256, generator=gen).bfloat16()
        want = on_threads(threads, after_by_operators, o, norm, gate_up, down, a, x)
        assert torch.equal(on_threads(threads, fused.after_attention, a, x), want), rows
    other = DotMLP(gate_up, down).after(o, Norm(norm.weight * 2, 1e-5))  # the negative control: another weight
    assert not torch.equal(other.after_attention(a, x), want)


@pytest.fixture
def switched_on(monkeypatch):
    monkeypatch.setenv("MESHNET_Q8DOT", "1")


@pytest.mark.parametrize("family,kind", [("llama", "Q4_1"), ("qwen2", "Q4_0"), ("llama", "Q4_K")])
def test_the_default_mode_on_the_kernel_is_batch_invariant(tmp_path, switched_on, family, kind):
    ex = default_mode(write_gguf(family, tmp_path, kind))
    linears = {type(m).__name__ for layer in ex.w.layers.values() for m in layer.modules() if "Linear" in type(m).__name__}
    assert linears == {"DotLinear"} and isinstance(ex.w.lm_head, DotLinear), linears
    assert ex._lean is not None and all(layer.mlp is not None and layer.mlp.o is not None
                                        for layer in ex._lean.layers.values())
    found = differences(ex)
    assert found == dict.fromkeys(found, 0) and len(found) == 9, found
    same = _lean_against_modules(ex)
    assert all(same) and len(same) == 10, same


def test_the_kernel_is_a_gguf_s_default_and_switched_off_torchs_kernels_stay(tmp_path, tiny_models, monkeypatch):
    monkeypatch.delenv("MESHNET_Q8DOT", raising=False)
    file = write_gguf("llama", tmp_path, "Q4_1")
    kinds = lambda ex: {type(m).__name__ for m in ex.w.layers[0].modules() if "Linear" in type(m).__name__}  # noqa: E731
    assert kinds(default_mode(file)) == {"DotLinear"}
    assert kinds(default_mode(tiny_models("llama"))) == {"Int8Linear"}  # a float model's --quant int8: torch's
    monkeypatch.setenv("MESHNET_Q8DOT", "0")
    assert kinds(default_mode(file)) == {"Int4Linear"}
    monkeypatch.setenv("MESHNET_Q8DOT", "1")
    monkeypatch.setenv("MESHNET_NATIVE", "0")
    assert not q8dot.wanted()


def test_the_same_bits_on_smollm2s_q4_1_file_on_the_kernel(switched_on, cache_root):
    ex = default_mode(smollm2(), cache_root=cache_root)
    assert isinstance(ex.w.lm_head, DotLinear) and ex._lean is not None
    found = differences(ex)
    assert found == dict.fromkeys(found, 0) and len(found) == 9, found
