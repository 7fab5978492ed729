"""The lean layers' norm and rotary embedding by one C call each give torch's operators' bits.

``fabric.compute.lean_ops`` replaces transformers' RMSNorm (about ten operators) and the rotary
embedding (five) by a call each to ``kernels/lean.c``. The bits must not move: the lean layers
promise the modules' bits (tests/test_lean_layers.py), and a node's default mode the same bits
for a position however it was batched (tests/test_invariant.py). Here each op is checked
against torch's on rows of the widths the served families use, and the check the kernel must
pass before it is used is shown able to fail.
"""
from __future__ import annotations

import pytest
import torch

from fabric.compute import lean_ops, native

# ATen's sum runs in vectors of 16 floats where torch runs its AVX-512 kernels: the kernel
# matches that order too, but only a machine with AVX-512 can show it, so elsewhere it is
# only required to match, not to be used.
ATEN_AVX512 = torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def _rows(n: int, rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).bfloat16()


@pytest.fixture
def kernel():
    if native.library("lean") is None:
        pytest.skip("no C compiler here: the lean ops run on torch's operators")
    return native.library("lean")


@pytest.mark.parametrize("n", [64, 128, 576, 896, 1000, 2048, 4096])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_norm_gives_torchs_bits(kernel, n, rows):
    weight = _rows(n, 1, seed=n)[0]
    norm = lean_ops.Norm(weight, 1e-5)
    assert norm.kernel is not None or ATEN_AVX512, "the kernel did not match torch's order on this CPU"
    x = _rows(n, rows, seed=rows)
    assert torch.equal(norm(x), lean_ops.torch_norm(x, weight, 1e-5))


@pytest.mark.parametrize("b,s", [(2, 5), (4, 1)])
def test_the_norm_per_head_reads_q_and_k_in_place(kernel, monkeypatch, b, s):
    """qwen3's q and k norms: one weight row per head, the heads read where the q/k/v product
    wrote them (a view whose rows skip the values; a decode batch's (b, 1) view gives its
    position dim a stride that is not b's over 1, and is read in place all the same)."""
    heads, kv, d = 6, 2, 128
    weight = torch.cat([_rows(d, 1, 1).expand(heads - kv, -1), _rows(d, 1, 2).expand(kv, -1)])
    qkv = _rows((heads + kv) * d, b * s, seed=3)
    qk = qkv[:, :heads * d].view(b, s, heads, d)
    norm = lean_ops.Norm(weight, 1e-6)
    if norm.kernel is None:
        assert ATEN_AVX512, "the kernel did not match torch's order on this CPU"
        pytest.skip("torch's operators keep the norm here")
    want = lean_ops.torch_norm(qk, weight, 1e-6)
    monkeypatch.setattr(lean_ops, "torch_norm", _not_called)
    assert torch.equal(norm(qk), want)


def test_the_order_of_the_sum_is_what_the_check_tells_apart(kernel):
    """The negative control: the squares added in another order (another vector width, or one
    by one) give other sums, float for float, so the check that picks the width can fail."""
    n = 576
    lanes = lean_ops._lanes(n)
    if lanes is None:
        pytest.skip("the kernel's order does not match this CPU's ATen: nothing to tell apart")
    x = _rows(n, 64, seed=5)
    want = x.float().pow(2).sum(-1)
    assert torch.equal(lean_ops.square_sums(x, lanes), want)
    for other in {8, 16, 1} - {lanes}:
        assert not torch.equal(lean_ops.square_sums(x, other), want), other


@pytest.mark.parametrize("b,s", [(1, 1), (1, 9), (4, 1), (3, 7)])
def test_the_rotary_embedding_gives_torchs_bits(kernel, monkeypatch, b, s):
    heads, kv, d = 9, 3, 64
    qkv = _rows((heads + 2 * kv) * d, b * s, seed=b * s)
    qk = qkv[:, :(heads + kv) * d].view(b, s, heads + kv, d)
    cos, sin = _rows(d, b * s, seed=11).view(b, s, d), _rows(d, b * s, seed=12).view(b, s, d)
    rotary = lean_ops.Rotary(cos, sin)
    assert rotary.kernel is not None
    want = lean_ops.torch_rope(qk, rotary.tables)
    monkeypatch.setattr(lean_ops, "torch_rope", _not_called)  # the kernel reads every such view in place
    assert torch.equal(rotary(qk), want)


def _not_called(*args):
    raise AssertionError("torch's operators ran where the kernel should have")


def test_tables_shared_by_a_batchs_rows_are_read_in_place(kernel):
    """A batch's rows at one position share their tables (a stride of 0 over the batch)."""
    d = 64
    cos, sin = (_rows(d, 1, seed=k).view(1, 1, d).expand(4, 1, d) for k in (1, 2))
    qk = _rows(8 * d, 4, seed=3).view(4, 1, 8, d)
    rotary = lean_ops.Rotary(cos, sin)
    assert torch.equal(rotary(qk), lean_ops.torch_rope(qk, rotary.tables))


def test_tables_of_another_shape_are_broadcast_as_torch_does(kernel):
    """Tables the kernel cannot walk position by position (one position for many) go to torch."""
    d = 64
    cos, sin = (_rows(d, 1, seed=k).view(1, 1, d) for k in (1, 2))
    qk = _rows(8 * d, 6, seed=3).view(2, 3, 8, d)
    rotary = lean_ops.Rotary(cos, sin)
    assert torch.equal(rotary(qk), lean_ops.torch_rope(qk, rotary.tables))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_passs_new_keys_go_into_the_cache_as_index_copy_puts_them(kernel, monkeypatch, dtype):
    """A decode pass's keys and values (rows, heads, 1, d), views of wider tensors as a layer's
    products give them, land in the RowGroup's lines in one C call, bit for bit where torch's
    ``index_copy_`` puts them, which then does not run; float32 (exact mode) keeps torch's."""
    from fabric.compute.rows import RowGroup

    rows, heads, d = 3, 2, 64
    group = RowGroup(0, 1)
    for n, session in enumerate("abc"):
        group.join(session, {i: (torch.randn(1, heads, 5 + n, d).to(dtype),) * 2 for i in (0, 1)})
    step = group.step_cache(0, rows)
    wide = torch.randn(rows, 1, 3 * heads, d).to(dtype)  # a qkv product: k and v are views into it
    k, v = wide[:, :, heads:2 * heads].transpose(1, 2), wide[:, :, 2 * heads:].transpose(1, 2)
    want_k, want_v = group.keys[1].clone(), group.values[1].clone()
    want_k.view(-1, d).index_copy_(0, step.lines, k.reshape(-1, d))
    want_v.view(-1, d).index_copy_(0, step.lines, v.reshape(-1, d))
    copies = []
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda *a, **kw: copies.append(a))
    step.update(k, v, 1)
    assert not copies
    assert torch.equal(group.keys[1], want_k) and torch.equal(group.values[1], want_v)
    assert not lean_ops.put_lines(group.keys[1].float(), group.values[1].float(), step.lines, k.float(), v.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width,rows", [(49152, 1), (576, 4), (7, 3)])
def test_an_audits_sketch_in_one_call_gives_index_adds_bits(kernel, monkeypatch, dtype, width, rows):
    """A tap's count sketch (a tail's logits, a hop's hidden rows, a view with rows apart) by the C
    kernel: the same float32 bits as torch's ``index_add_`` of the same products in the same
    order, which then does not run."""
    from fabric.node import verdicts
    from fabric.wire.protocol import SKETCH_DIM

    wide = (torch.randn(rows, 2 * width) * torch.logspace(-3, 3, 2 * width)).to(dtype)
    x = wide[:, :width]  # rows 2 * width apart
    bucket, sign = verdicts._buckets(width)
    want = torch.zeros(rows, SKETCH_DIM).index_add_(1, bucket, x.float() * sign)
    adds = []
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda *a, **kw: adds.append(a))
    got = verdicts.sketch(x)
    assert not adds and got.dtype == torch.float32 and torch.equal(got, want)
