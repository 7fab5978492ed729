#!/usr/bin/env python
"""What the default mode costs in quality, per GGUF type: top-1 agreement with float32, and perplexity.

    python bench/quality.py [--types Q4_0,Q4_1,Q4_K,Q5_0,Q5_K,Q6_K,Q8_0,F16,Q3_K] [--tokens 512]

SmolLM2-135M's weights (its Q4_1 file, dequantized) are written again in each type (every
matrix; norms stay F32), with the same tokenizer and metadata. Its rows of 576 are no whole
number of K-quant super-blocks, so there, as llama.cpp does, a K type falls back (Q4_K to Q5_0,
Q5_K to Q5_1, Q6_K to Q8_0, Q3_K to Q4_0): a "Q4_K" file holds ffn_down (rows of 1536) in
Q4_K and the rest in Q5_0. For each file, one fixed text
is run teacher-forced through the whole model twice: exact (float32, the file dequantized)
and the default mode (``--quant auto``: each type on its kernel). Printed per type:

- top-1 agreement: the share of positions where both pick the same next token;
- the perplexity of the text under each;
- where the default mode's weights sit: the file's own codes or re-rounded.

The cost measured is the default mode's against the same file in float32, not the file's
own quantization against the original model (which no kernel choice can undo).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders stopped to "
    "rest on their way to the coast. Over the centuries the settlement grew into a market town, and "
    "later into a centre of learning, with a university founded in the thirteenth century. Its old "
    "bridge, rebuilt twice after floods, still carries people across the water every day. In the "
    "nineteenth century the railway arrived, and with it factories, new streets and a population "
    "that doubled within a generation. Today the city is known for its museums, its parks and its "
    "food: visitors come to walk along the river, to see the cathedral and to taste the local bread. "
    "The climate is mild, with warm summers and cool, wet winters. Most people work in services, "
    "education and health care, and many commute from the villages around it. Every autumn a music "
    "festival fills the squares, and in spring the gardens open to the public. Scientists at the "
    "university study the river's fish, the soil of the surrounding farms and the stars, from an "
    "observatory on the hill above the town. Water is the oldest of the city's stories."
)


FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "Q4_0"}  # llama.cpp's, for rows % 256


def rewrite(source: Path, target: Path, type_name: str) -> Path:
    """``source`` GGUF written again with every matrix in ``type_name`` (metadata copied)."""
    import gguf
    from gguf import GGUFReader, GGUFValueType

    from tests.gguf_models import encode

    reader = GGUFReader(str(source))
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        kind = type_name if values.ndim == 2 else "F32"
        if kind in FALLBACK and values.shape[-1] % 256:  # as llama.cpp: a row of no whole super-blocks
            kind = FALLBACK[kind]
        data = encode(values, kind)
        writer.add_tensor(t.name, data, raw_dtype=None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@torch.inference_mode()
def logits_of(path: Path, quant: str | None, ids: list[int]) -> torch.Tensor:
    """(positions, vocab) float32 logits of the text through the whole model, one pass."""
    from fabric.compute.executor import ShardExecutor
    from fabric.compute.kv import KVStore
    from fabric.compute.models import load_config, load_shard, resolve
    from fabric.wire.shard import Shard

    source = resolve(str(path))
    n = load_config(source).num_hidden_layers
    executor = ShardExecutor(load_shard(source, Shard(0, n - 1, n), quant=quant, progress=False), KVStore())
    out = []
    for pos in range(len(ids)):  # decode steps: the tail returns the last position's logits
        result = executor.run("q", 0, n - 1, torch.tensor([ids[pos:pos + 1]]) if pos else torch.tensor([ids[:1]]),
                              pos)
        out.append(result.logits)
    return torch.stack(out)


def compare(path: Path, ids: list[int]) -> dict:
    from fabric.compute.model_ref import pick_quant, resolve

    scheme, why = pick_quant("auto", resolve(str(path)))
    exact, default = logits_of(path, None, ids), logits_of(path, scheme, ids)
    targets = torch.tensor(ids[1:])

    def perplexity(logits: torch.Tensor) -> float:
        return float(torch.exp(torch.nn.functional.cross_entropy(logits[:-1], targets)))

    agree = float((exact.argmax(-1) == default.argmax(-1)).float().mean())
    return {"scheme": scheme, "why": why, "agree": agree, "ppl_exact": perplexity(exact),
            "ppl_default": perplexity(default)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_0,Q4_1,Q4_K,Q5_0,Q5_K,Q6_K,Q8_0,F16,Q3_K")
    parser.add_argument("--tokens", type=int, default=256, help="positions of the text to score")
    args = parser.parse_args()
    from fabric.compute.models import load_tokenizer, resolve

    source = resolve("smollm2-135m")
    ids = load_tokenizer(source)(TEXT)["input_ids"][: args.tokens]
    print(f"SmolLM2-135M, {len(ids)} positions of a fixed text; default mode against float32 on the same file")
    print(f"{'type':<6} {'scheme':<6} {'top-1 agree':>11} {'ppl float32':>11} {'ppl default':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.types.split(","):
            path = source.path if kind == "Q4_1" else rewrite(source.path, Path(tmp) / f"smollm2-{kind}.gguf", kind)
            r = compare(path, ids)
            print(f"{kind:<6} {r['scheme'] or 'none':<6} {r['agree']:>11.3f} {r['ppl_exact']:>11.2f} "
                  f"{r['ppl_default']:>11.2f}", flush=True)
            if path != source.path:
                path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
