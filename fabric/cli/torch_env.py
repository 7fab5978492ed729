"""Environment that torch, OpenMP and transformers read once, at load: set before a node
imports torch, and left alone when the user set it."""
from __future__ import annotations

import os
import types


def omp_workers_nap(weight_only: bool = False) -> None:
    """Before torch loads: idle OpenMP workers spin only briefly (GOMP_SPINCOUNT=10000), then
    sleep; on the weight-only kernels (``weight_only``) they sleep at once (OMP_WAIT_POLICY=PASSIVE).

    libgomp's default spins ~300 000 times after every parallel region: nodes share hosts (with
    each other, the web UI, anything) and that spinning takes the cores a busy node needs
    (3-7x slower decode steps measured on a loaded 2-core machine). Sleeping at once
    (OMP_WAIT_POLICY=PASSIVE) costs ~25% inside a float32 forward pass, whose regions follow each
    other within microseconds; a short spin keeps most of that. The weight-only kernels split
    even a small matrix over every thread, so a token is hundreds of short regions: on the
    loaded 2-core machine a short spin there cost 118-144 CPU ms per int4 token against 20-22
    sleeping at once (19 with one thread; SmolLM2-135M, two nodes). Either variable set wins.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        if weight_only:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            os.environ["GOMP_SPINCOUNT"] = "10000"


def grouped_kv_attention() -> None:
    """Let torch's attention read grouped KV heads as they are.

    For a query longer than one token with a mask, transformers expands the KV heads of
    grouped-query models (``repeat_kv``) before calling SDPA on the CPU: a copy of the whole
    cache per layer. A prefill slice late in a long prompt spent ~14 of its ~55 ms there.
    SDPA's own ``enable_gqa`` gives the same numbers without the copy.
    """
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")


# Packages installed beside meshnet that transformers, accelerate or httpx import when they find
# them, for work a node never does. Measured on a node's imports (torch 2.13, transformers 5.24;
# `python bench/node_floor.py --keep-all` against without): about 48 MiB of a node's runtime
# floor of 391, and one thread (scipy's OpenBLAS pool).
NOT_IN_A_NODE = {
    # transformers.loss imports scipy.optimize (the Hungarian matching of object-detection
    # losses) when scipy is installed: 500 modules, about 37 MiB
    "scipy": "the object-detection losses of transformers",
    # accelerate's `accelerate config` wizard imports boto3 (and botocore, s3transfer) for
    # SageMaker when boto3 is installed: about 10 MiB
    "boto3": "accelerate's SageMaker configuration",
    # httpcore imports trio for its trio backend, used only by a program running under trio
    # (the node downloads nothing): about 3 MiB
    "trio": "httpcore's trio backend",
}


def leave_out_unused_packages(names=NOT_IN_A_NODE) -> list[str]:
    """Before torch and transformers load: make the packages in ``names`` look absent to this
    process, so that the libraries' optional imports of them are skipped (``sys.modules[name] =
    None``: ``importlib.util.find_spec`` answers None and ``import name`` raises ImportError).

    Only for the node process, whose every import happens at start (``cmd_node`` imports the
    node, the model classes and, on a head, the tokenizer before it serves): a library that
    needed one of these in the middle of a request would fail there, not here, so the list
    holds only packages that no model family meshnet runs touches (tests/test_node_imports.py
    runs a node of each family with them left out). A package already imported stays.
    Returns the names left out."""
    import sys

    left = [name for name in names if name not in sys.modules]
    for name in left:
        sys.modules[name] = None
    return left


def leave_out_compiler_and_collectives() -> None:
    """After torch loads, before transformers does: a node neither compiles nor joins a
    torch.distributed group, so the libraries' import-time uses of either load nothing.

    transformers' model code imports, at import time, torch.distributed.tensor (when
    ``torch.distributed.is_available()``) and torch._dynamo (for decorators such as
    ``@torch._dynamo.assume_constant_result`` and ``@torch.compiler.disable``), which bring
    torch._inductor, torch.onnx and sympy: about 70 MiB of every node's runtime floor
    (``python bench/node_floor.py``), a tenth of a 1.7B half-model node.
    - ``torch.distributed.is_available()`` answers False in this process, as on a torch built
      without it, a build transformers supports.
    - ``torch._dynamo`` is a stand-in until something asks it for more than the decorators that
      are the function itself in eager execution; then the real module loads and answers, so
      nothing breaks, it only costs the memory again (tests/test_node_imports.py checks that a
      llama and a MoE route serve without it; the suite's nodes all start this way).
    A no-op where the real torch._dynamo is already loaded."""
    import sys

    import torch

    if "torch._dynamo" in sys.modules:
        return
    torch.distributed.is_available = lambda: False
    compiler = _CompilerNotLoaded("torch._dynamo")
    compiler.__path__ = [os.path.join(os.path.dirname(torch.__file__), "_dynamo")]  # its submodules load as files
    sys.modules["torch._dynamo"] = compiler


def _as_is(fn=None, *_, **__):
    """A compiler decorator in eager execution: the function itself (``disable()`` with no function
    first returns the decorator)."""
    return fn if fn is not None else _as_is


class _CompilerNotLoaded(types.ModuleType):
    """torch._dynamo until a caller needs the compiler: the eager-only decorators answer as
    themselves, anything else loads the real module (and answers from it from then on)."""

    AS_IS = ("assume_constant_result", "allow_in_graph", "disable")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # inspect and importlib probe modules' dunders: no reason to load
            raise AttributeError(name)
        if name in self.AS_IS:
            return _as_is
        import importlib
        import sys

        if sys.modules.get("torch._dynamo") is self:
            del sys.modules["torch._dynamo"]
        return getattr(importlib.import_module("torch._dynamo"), name)
