"""Small C kernels, built once per machine with its own instruction set and kept in the cache.

A kernel here exists because torch has no operator that does the job with the arithmetic the
job needs (fabric/compute/kernels/attention.c: the same bits for a position in any chunk or
batch). It is compiled on first use with the C compiler the machine has (``cc``, or ``$CC``),
``-O3 -march=native`` and OpenMP, and loaded with ctypes: no torch headers, so a build takes a
second. The shared object is kept under the cache root, named by a digest of the source, the
compiler, the flags and the CPU, so a CPU or compiler change builds anew and a home directory
shared by two machines never loads the other's.

Where there is no compiler, or ``MESHNET_NATIVE=0``, ``library`` returns None after one
warning and the caller keeps its torch path. ``MESHNET_NATIVE_ARCH`` names another ``-march``
target: ``x86-64-v3`` builds the AVX2 code an AVX2-only CPU runs, on a CPU that has more
(with ``ATEN_CPU_CAPABILITY=avx2`` for torch's own kernels: ``bench/concurrency.py --avx2``).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from fabric.compute.model_ref import default_cache_root

log = logging.getLogger(__name__)
SOURCES = Path(__file__).with_name("kernels")
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
BUILD_TIMEOUT_S = 120
# Multiply-adds a kernel call gives each thread at least. Waking an OpenMP worker costs more than a
# small product saves (a node's workers sleep between regions, fabric/cli/torch_env.py): a
# SmolLM2-135M token is ~150 products of 0.3-0.9 M multiply-adds, and one node at 2 threads
# decoded at 0.5x its speed at 1 thread until those ran on one (docs/BENCHMARKS.md, "Threads
# for small products"). Calls between this and a few hundred times it learn their own count
# (fabric/compute/splits.py). A kernel's bits never depend on its thread count.
WORK_PER_THREAD = 2_000_000


def enabled() -> bool:
    """False where the user turned the kernels off (``MESHNET_NATIVE=0``)."""
    return os.environ.get("MESHNET_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def flags() -> list[str]:
    """The compiler's flags: this CPU's instruction set unless ``MESHNET_NATIVE_ARCH`` names one."""
    return [*FLAGS, f"-march={os.environ.get('MESHNET_NATIVE_ARCH', '').strip() or 'native'}"]


def threads_for(work: int, threads: int) -> int:
    """How many of ``threads`` a kernel call of ``work`` multiply-adds runs on."""
    return max(1, min(threads, work // WORK_PER_THREAD))


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """The built kernel ``kernels/<name>.c``, loaded; None where it cannot be had (warned once)."""
    if not enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.warning("no C compiler (cc): %s runs on torch's slower path", name)
        return None
    try:
        return ctypes.CDLL(str(_built(name, compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not build the %s kernel (%s): it runs on torch's slower path", name,
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None


def _built(name: str, compiler: str) -> Path:
    """The shared object for ``name``: the cached one, or one built now."""
    source = SOURCES / f"{name}.c"
    key = hashlib.sha256(source.read_bytes() + "\0".join([_version(compiler), *flags(), _cpu()]).encode())
    target = default_cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # concurrent builders never meet
        built = Path(scratch) / target.name
        done = subprocess.run([compiler, *flags(), "-o", str(built), str(source), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode:
            raise OSError(done.stderr or f"{compiler} exited {done.returncode}")
        os.replace(built, target)
    log.info("built the %s kernel: %s", name, target)
    return target


def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def _cpu() -> str:
    """The CPU's model and flags: the instruction set -march=native builds for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
