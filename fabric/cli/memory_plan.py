"""Where a node's weights go and how they are held: the device check, the quantization scheme
``--quant`` resolves to, and how many layers fit ``--memory``. Asked before torch loads where it
can be, so a bad choice fails before any weights do."""
from __future__ import annotations

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
