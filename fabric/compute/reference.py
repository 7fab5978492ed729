"""A single-process transformers model holding the very weights a quantized shard holds:
the reference that tests and benches compare a split in the default mode against."""
from __future__ import annotations

from pathlib import Path

import torch

from .models import ModelSource, file_placement, grid_modules
from .quant import quantize


def load_quantized_reference(directory, *, gguf_file: str | None = None, scheme: str = "int8", cache_root=None):
    """``AutoModelForCausalLM`` in bfloat16, quantized as ``load_shard(quant=scheme)`` puts a
    shard: a GGUF's linears placed by their tensor types (``fabric.compute.gguf_grid``), attending
    and running experts as a bfloat16 shard on a CPU does (``fabric.compute.attention``,
    ``fabric.compute.experts``)."""
    from transformers import AutoModelForCausalLM

    from . import attention, experts

    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.bfloat16,
                                                 attn_implementation=attention.NAME,
                                                 experts_implementation=experts.NAME)
    placement = {}
    if gguf_file and scheme in ("int4", "gguf"):  # a file's 4-bit grids (and, under gguf, its float types)
        path = Path(directory) / gguf_file
        placement = grid_modules(model, file_placement(ModelSource("gguf", path, path.stem), scheme, cache_root))
    return quantize(model.eval(), scheme, placement)
