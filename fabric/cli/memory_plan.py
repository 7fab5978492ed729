"""Where a node's weights go and how they are held: the device check, the quantization scheme
``--quant`` resolves to, and how many layers fit ``--memory``. Asked before torch loads where it
can be, so a bad choice fails before any weights do."""
from __future__ import annotations

import math

import logging

from ..flags import CommandError

log = logging.getLogger("meshnet")


def check_device_flags(device: str, quant: str) -> None:
    """CommandError when ``device`` cannot compute here (with ``quant``): the check
    ``load_shard`` makes, before anything starts (``auto`` fits any device)."""
    from ..compute.models import ModelError, check_device

    try:
        check_device(device, None if quant == "auto" else quant)
    except ModelError as exc:
        raise CommandError(str(exc)) from None


def runs_weight_only(args) -> bool:
    """Will this node's layers run on the weight-only kernels? Asked before torch loads; a bad
    --model is left for ``_node_config`` to report, after the other flags' checks."""
    from ..compute.model_ref import ModelError, pick_quant, resolve

    try:
        auto = args.quant == "auto"
        return pick_quant(args.quant, resolve(args.model) if auto else None, args.device)[0] is not None
    except ModelError:
        return False


def picked_quant(quant: str, model: str, device: str) -> str:
    """``--quant`` as a scheme for ``model`` on ``device`` (``auto``: a GGUF's own grid), said in
    the log. Torch stays unloaded (see ``node_command.cmd_node``)."""
    from ..compute.model_ref import ModelError, pick_quant, resolve

    try:
        scheme, why = pick_quant(quant, resolve(model) if quant == "auto" else None, device)
    except ModelError as exc:
        raise CommandError(str(exc)) from None
    if quant == "auto":
        mode = (f"on its own grid, --quant {scheme}: weight-only kernels, bfloat16 compute; for the exact tokens "
                "of transformers use --quant none --dtype float32" if scheme else "--quant none, in --dtype")
        log.info("%s: %s (%s)", model, mode, why)
    return scheme or "none"


def layers_that_fit(model_config, dtype, memory_gib: float, quant: str | None = None) -> int:
    """How many layers fit ``memory_gib`` of weights (0: no budget given), quantized by ``quant``."""
    if memory_gib <= 0:
        return 0
    from ..compute.models import layer_bytes
    from ..compute.quant import quantized_layer_bytes

    held = quantized_layer_bytes(model_config, "int8" if quant == "gguf" else quant) if quant else layer_bytes(
        model_config, dtype)  # gguf: int8 bounds its mix from above (Q4_* take less)
    fit = int(memory_gib * (1 << 30) // held)
    if fit < 1:
        raise ValueError(f"--memory {memory_gib} GiB does not hold even one layer of this model")
    return fit


BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5, "float32": 4.0, "bfloat16": 2.0}  # held in memory, by --quant/--dtype
GGUF_GRID_BOUND = 1.25  # a GGUF's layers on its own grid hold at most this times their share of the file (DESIGN)


def layers_that_fit_manifest(manifest, memory_gib: float, quant: str, dtype: str) -> int:
    """As ``layers_that_fit``, from a GGUF's manifest alone (a node about to fetch its layers from
    peers has no config yet): its largest layer's bytes in the file (``--quant auto`` or ``gguf``:
    on the file's own grid) or weights (other modes), at what each holds in memory."""
    if memory_gib <= 0:
        return 0
    files: dict[int, int] = {}
    weights: dict[int, int] = {}
    for t in manifest.tensors:
        if t.layer is not None:
            files[t.layer] = files.get(t.layer, 0) + t.nbytes
            weights[t.layer] = weights.get(t.layer, 0) + math.prod(t.shape)
    if quant in ("auto", "gguf"):
        held = GGUF_GRID_BOUND * max(files.values(), default=1)
    else:
        held = BYTES_PER_WEIGHT[quant if quant in ("int8", "int4") else dtype] * max(weights.values(), default=1)
    fit = int(memory_gib * (1 << 30) // held)
    if fit < 1:
        raise ValueError(f"--memory {memory_gib} GiB does not hold even one layer of this model")
    return fit


# What a head's tokenizer holds, per token of its vocabulary: SmolLM2's (49,152 tokens, a fast
# BPE tokenizer read from its tokenizer.json) holds 17.6 MiB once the heap its parsing freed is
# returned (`python bench/node_floor.py`), about 375 bytes a token.
TOKENIZER_BYTES_PER_TOKEN = 375


def end_bytes(model_config, gguf: bool, dtype, quant: str | None) -> tuple[int, int]:
    """(first, last): what a node holding the first layer, and one holding the last, hold
    beyond their layers. The first: the tokenizer, and the token embedding where it loads whole
    (a GGUF's stays in the file, its rows read as they are looked up). The last: the lm_head,
    int8 under a quantization scheme (a GGUF's tied one too), else in ``dtype``."""
    import torch

    vocab = getattr(model_config, "vocab_size", 0) or 0
    matrix = vocab * model_config.hidden_size
    element = torch.empty((), dtype=dtype).element_size()
    first = vocab * TOKENIZER_BYTES_PER_TOKEN + (0 if gguf else matrix * element)
    return first, matrix * (1 if quant else element)


def balanced_shards(source, model_config, parts: int, dtype, quant: str | None) -> list:
    """``parts`` shards of the model whose largest estimated memory is least: each end of the
    model takes fewer layers where it holds more (``end_bytes``); an even split otherwise."""
    from ..compute.models import layer_bytes
    from ..compute.quant import quantized_layer_bytes
    from ..wire.shard import balanced_split

    held = quantized_layer_bytes(model_config, "int8" if quant == "gguf" else quant) if quant else layer_bytes(
        model_config, dtype)  # gguf: int8 bounds its mix from above, as in layers_that_fit
    first, last = end_bytes(model_config, source.kind == "gguf", dtype, quant)
    return balanced_split(model_config.num_hidden_layers, parts, held, first, last)
