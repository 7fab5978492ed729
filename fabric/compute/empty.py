"""A model's architecture without its weights: transformers' own classes on the meta device,
no initialiser run.

The weights come later (a shard's from its file). Arithmetic on meta tensors runs through
torch's Python reference implementations, whose checks import sympy and torch's symbolic
shapes: about 35 MiB of a node's memory that nothing else needs (``python bench/node_floor.py``).
So while the classes are built, ``torch.arange`` without a device makes CPU tensors: what
constructors compute from ranges (RoPE's frequencies) are small buffers, computed as they are
when a model runs. A family whose constructor mixes such a range with a parameter is built
again as transformers builds it, ranges on the meta device too.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


def empty_model(config):
    """``AutoModelForCausalLM`` of ``config``, its parameters on the meta device and its
    initialisers skipped (weights tied as the config says)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        with torch.device("meta"), no_init_weights(), _ranges_on_cpu():
            return AutoModelForCausalLM.from_config(config)
    except RuntimeError as e:  # a range met a meta parameter: build it all on meta
        log.debug("%s: built with its ranges on the meta device (%s)", config.model_type, e)
    with torch.device("meta"), no_init_weights():
        return AutoModelForCausalLM.from_config(config)


def one_layer(config):
    """The first decoder layer of ``config``'s architecture, without weights (for sizing one layer)."""
    fields = {**config.to_dict(), "num_hidden_layers": 1}
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][:1]
    return empty_model(config.__class__.from_dict(fields)).model.layers[0]


@contextmanager
def _ranges_on_cpu():
    arange = torch.arange

    def on_cpu(*args, **kwargs):
        kwargs.setdefault("device", "cpu")
        return arange(*args, **kwargs)

    torch.arange = on_cpu
    try:
        yield
    finally:
        torch.arange = arange
