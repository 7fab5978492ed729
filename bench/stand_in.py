#!/usr/bin/env python
"""A stand-in for a model where its weights cannot go: same config and tokenizer, random weights.

    python bench/stand_in.py OUT [--model smollm2-135m]       # config + tokenizer only (a few MB)
    python bench/stand_in.py OUT --weights [--dtype bfloat16]  # add random weights of the same shapes
    python bench/stand_in.py OUT --weights --set num_hidden_layers=24 hidden_size=2048 ...  # another size

Speed depends on shapes, not values, so a stand-in benchmarks like the model it copies. The
first form is small enough to carry to another machine; the second, run there, writes
``model.safetensors`` (seeded, transformers' own initialisation) beside them. Every bench
then takes ``--model OUT``; greedy ids are still checked against transformers running the
same stand-in weights. ``--set`` changes config fields first, for a stand-in of a size that
is not at hand (``bench/memory.py`` uses one of SmolLM2-1.7B's shape).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write (a Hugging Face model directory)")
    parser.add_argument("--model", default=None,
                        help="model to copy the config and tokenizer of (default smollm2-135m; "
                             "with --weights, OUT's own config when it has one)")
    parser.add_argument("--weights", action="store_true", help="also write random weights")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config fields to change (JSON values: 24, 2048, true)")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fabric.compute.models import (
        default_cache_root,
        load_config,
        load_tokenizer,
        resolve,
    )

    has_config = (args.out / "config.json").is_file()
    if args.model or not has_config:
        source = resolve(args.model or "smollm2-135m")
        args.out.mkdir(parents=True, exist_ok=True)
        load_config(source, default_cache_root()).save_pretrained(args.out)
        load_tokenizer(source, default_cache_root()).save_pretrained(args.out)
    if args.set:
        config = AutoConfig.from_pretrained(args.out)
        for item in args.set:
            key, _, value = item.partition("=")
            if not hasattr(config, key):
                parser.error(f"--set {item}: the config has no field {key!r}")
            setattr(config, key, json.loads(value))
        config.save_pretrained(args.out)
    if args.weights:
        torch.manual_seed(args.seed)
        config = AutoConfig.from_pretrained(args.out)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
        model.save_pretrained(args.out)
    print(f"wrote {args.out}{' with random weights' if args.weights else ' (config and tokenizer)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
