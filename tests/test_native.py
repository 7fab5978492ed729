"""The C kernels are built once per machine, kept in the cache, and never needed: without a
compiler, or with ``MESHNET_NATIVE=0``, the caller is told None (with one warning) and keeps
its torch path."""
from __future__ import annotations

import logging
import shutil

import pytest

from fabric.compute import native


def build(monkeypatch, cache, **env):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return native.library.__wrapped__("attention")  # past the per-process cache


@pytest.fixture
def compiler():
    found = shutil.which("cc") or shutil.which("gcc")
    assert found, "no C compiler here: the default mode's attention would run on its slower path"
    return found


def test_a_kernel_is_built_once_and_then_loaded_from_the_cache(monkeypatch, tmp_path, compiler, caplog):
    caplog.set_level(logging.INFO, logger=native.__name__)
    assert build(monkeypatch, tmp_path) is not None
    built = list((tmp_path / "meshnet" / "kernels").glob("attention-*.so"))
    assert len(built) == 1 and "built the attention kernel" in caplog.text
    made = built[0].stat().st_mtime_ns
    caplog.clear()
    assert build(monkeypatch, tmp_path) is not None
    assert built[0].stat().st_mtime_ns == made and "built" not in caplog.text
    assert not [p for p in built[0].parent.iterdir() if p.is_dir()]  # no build left half-done


def test_a_compiler_that_fails_leaves_the_torch_path_with_one_warning(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=native.__name__)
    assert build(monkeypatch, tmp_path, CC=shutil.which("false")) is None
    assert "could not build the attention kernel" in caplog.text
    assert not list((tmp_path / "meshnet" / "kernels").glob("*.so"))


def test_no_compiler_leaves_the_torch_path(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=native.__name__)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert build(monkeypatch, tmp_path) is None
    assert "no C compiler" in caplog.text


def test_the_kernels_can_be_turned_off(monkeypatch, tmp_path, compiler):
    assert build(monkeypatch, tmp_path, MESHNET_NATIVE="0") is None
    assert not (tmp_path / "meshnet" / "kernels").exists()


def test_another_cpu_gets_its_own_build(monkeypatch, tmp_path, compiler):
    """A home shared by two machines never loads the other's -march=native build."""
    assert build(monkeypatch, tmp_path) is not None
    monkeypatch.setattr(native, "_cpu", lambda: "flags : sse2")
    assert build(monkeypatch, tmp_path) is not None
    assert len(list((tmp_path / "meshnet" / "kernels").glob("attention-*.so"))) == 2


def test_a_small_product_runs_on_one_thread_and_a_large_one_on_all():
    from fabric.compute.native import WORK_PER_THREAD, threads_for

    assert threads_for(576 * 576, 2) == 1  # a SmolLM2 projection for one row: waking a worker costs more
    assert threads_for(2048 * 2048, 2) == 2 and threads_for(49152 * 576, 8) == 8
    assert threads_for(3 * WORK_PER_THREAD, 8) == 3 and threads_for(10 ** 9, 1) == 1 and threads_for(0, 4) == 1


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
def test_another_target_builds_apart_and_runs_that_targets_code(monkeypatch, tmp_path, compiler):
    """``MESHNET_NATIVE_ARCH=x86-64-v3`` builds the AVX2 code an AVX2-only CPU runs, beside this
    CPU's own build, never in its place (bench/concurrency.py --avx2)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("MESHNET_NATIVE_ARCH", "x86-64-v3")
    avx2 = native.library.__wrapped__("q8dot")
    assert avx2 is not None and avx2.meshnet_q8dot_path() == 1  # the AVX2 path (0: plain C, 2: AVX-512 VNNI)
    monkeypatch.delenv("MESHNET_NATIVE_ARCH")
    assert native.library.__wrapped__("q8dot") is not None
    assert len(list((tmp_path / "meshnet" / "kernels").glob("q8dot-*.so"))) == 2
