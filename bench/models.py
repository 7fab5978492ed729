#!/usr/bin/env python
"""A bigger model at CI size: a synthetic GGUF of a 1-2B shape, split over 1, 2 and 3 nodes.

    python bench/models.py [--shape 1.7b|1b|gemma3-270m] [--nodes 1,2,3] [--tokens 64] [--keep DIR]
                           [--file PATH] [--no-llama-cpp] [--split balanced|even]

Writes a GGUF of random weights in a Q4_K_M-like mix (Q4_K, and Q6_K for attn_v, ffn_down and
the embedding; llama.cpp's fallbacks where a row is not a multiple of 256: Q5_0 for Q4_K,
Q8_0 for Q6_K) with SmolLM2's tokenizer, then for each node count starts a tracker and that
many ``meshnet node`` processes (the default mode, ``--quant auto``; layers split as ``meshnet up``
splits them, by memory) and reports:

- load time (spawn to routable) and each node's RSS after one greedy generation, once idle
  (it has handed back what the request freed, ``fabric.node.idle_trim``; the RSS as the
  request ended is printed beside it), above a bare node's (a process that imported what a
  node imports, left out what a node leaves out, and built the model on the meta device, no
  weights; for the head, which tokenizes, its tokenizer loaded too) against its share of the
  file; ``bench/node_floor.py`` breaks one node's RSS down by start-up stage;
- decode tokens/s of one stream (first token to last, ``--tokens`` tokens, ignore_eos);
- llama.cpp's (llama-cpp-python, one process, the same thread count: the machine's cores)
  decode tokens/s and RSS on the same file, where it is installed, measured before and after
  meshnet's runs (ratios are against their mean).

Speed depends on shapes, not values: random weights decode as fast as real ones. The
ratios printed are against numbers measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from concurrency import start_cluster  # noqa: E402
from fabric_bench import memory  # noqa: E402

from fabric.node.idle_trim import IDLE_TRIM_S  # noqa: E402

MIB = 2**20
# llama-arch shapes: hidden, layers, intermediate, heads, kv heads (head_dim hidden / heads)
SHAPES = {"1.7b": (2048, 24, 8192, 32, 32), "1b": (2048, 16, 8192, 32, 8)}
GEMMA3_270M = dict(hidden=640, layers=18, intermediate=2048, heads=4, kv_heads=1, head_dim=256, window=512,
                   vocab=262144)  # Gemma 3 270M's shape: its vocabulary is most of its weights
SMOLLM_VOCAB = 49152
FLOOR = """
import gc, psutil
from fabric.cli.torch_env import leave_out_compiler_and_collectives, leave_out_unused_packages
leave_out_unused_packages()  # as a node process does before torch loads
import torch
leave_out_compiler_and_collectives()  # and after
import transformers
import fabric.node, fabric.cli
from fabric.compute.empty import empty_model
from fabric.compute.models import default_cache_root, load_config, load_tokenizer, resolve
from fabric.compute.heap import release_freed_memory
empty_model(load_config(resolve({path!r}), default_cache_root()))  # as a node builds it: parsed once, cached
gc.collect()
release_freed_memory()  # as a node does once loaded: what loading freed goes back to the OS
tail = psutil.Process().memory_info().rss
tokenizer = load_tokenizer(resolve({path!r}), default_cache_root())
gc.collect()
release_freed_memory()
print(tail, psutil.Process().memory_info().rss)
"""


def mix(name: str, row: int) -> str:
    """Q4_K_M-like: Q6_K for attn_v, ffn_down and the embedding, Q4_K elsewhere, F32 for vectors;
    llama.cpp's fallbacks where a row is no whole number of 256-value super-blocks."""
    six = any(k in name for k in ("attn_v", "ffn_down", "token_embd", "output.weight"))
    if row % 256:
        return "Q8_0" if six else "Q5_0"
    return "Q6_K" if six else "Q4_K"


def tensor_shapes(shape: str) -> tuple[str, dict, list[tuple[str, tuple[int, ...]]]]:
    """(architecture, metadata numbers, [(tensor name, numpy shape)]) of a synthetic model."""
    if shape == "gemma3-270m":
        d = dict(GEMMA3_270M)
        arch = "gemma3"
    else:
        hidden, layers, inter, heads, kv = SHAPES[shape]
        d = dict(hidden=hidden, layers=layers, intermediate=inter, heads=heads, kv_heads=kv, head_dim=hidden // heads,
                 vocab=SMOLLM_VOCAB)
        arch = "llama"
    h, hd = d["hidden"], d["head_dim"]
    names = [("token_embd.weight", (d["vocab"], h))]
    for i in range(d["layers"]):
        blk = f"blk.{i}."
        names += [(blk + "attn_norm.weight", (h,)), (blk + "attn_q.weight", (d["heads"] * hd, h)),
                  (blk + "attn_k.weight", (d["kv_heads"] * hd, h)), (blk + "attn_v.weight", (d["kv_heads"] * hd, h)),
                  (blk + "attn_output.weight", (h, d["heads"] * hd)), (blk + "ffn_norm.weight", (h,)),
                  (blk + "ffn_gate.weight", (d["intermediate"], h)), (blk + "ffn_up.weight", (d["intermediate"], h)),
                  (blk + "ffn_down.weight", (h, d["intermediate"]))]
        if arch == "gemma3":
            names += [(blk + "attn_q_norm.weight", (hd,)), (blk + "attn_k_norm.weight", (hd,)),
                      (blk + "post_attention_norm.weight", (h,)), (blk + "post_ffw_norm.weight", (h,))]
    names.append(("output_norm.weight", (h,)))
    return arch, d, names


def write_file(path: Path, shape: str, seed: int = 0) -> Path:
    """A synthetic GGUF of ``shape`` (random weights, the mix above, SmolLM2's tokenizer),
    written a tensor at a time."""
    import gguf

    from tests.gguf_models import encode

    arch, d, names = tensor_shapes(shape)
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, arch, d, shape)
    kinds = {name: "F32" if len(shp) == 1 else mix(name, shp[-1]) for name, shp in names}
    for name, shp in names:
        if kinds[name] == "F32":
            writer.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        else:
            qtype = gguf.GGMLQuantizationType[kinds[name]]
            byte_shape = gguf.quant_shape_to_byte_shape(shp, qtype)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in names:
        values = (np.ones(shp, np.float32) if len(shp) == 1 else
                  rng.standard_normal(shp, dtype=np.float32) * np.float32(0.02))
        writer.write_tensor_data(encode(values, kinds[name]))
    writer.close()
    return path


def _metadata(writer, arch: str, d: dict, shape: str) -> None:
    """The model's numbers, and SmolLM2's tokenizer (its vocabulary padded to ``d["vocab"]``)."""
    from gguf import GGUFReader, GGUFValueType

    from fabric.compute.models import ALIASES, alias_path

    writer.add_name(f"synthetic-{shape}")
    writer.add_block_count(d["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(d["hidden"])
    writer.add_feed_forward_length(d["intermediate"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_key_length(d["head_dim"])
    writer.add_value_length(d["head_dim"])
    writer.add_rope_dimension_count(d["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(d["vocab"])
    if arch == "gemma3":
        writer.add_sliding_window(d["window"])
    smollm = GGUFReader(str(alias_path(ALIASES["smollm2-135m"])))
    pad = d["vocab"] - SMOLLM_VOCAB  # SmolLM2's tokenizer, its vocabulary padded as llama.cpp pads one
    for key, field in smollm.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            if key == "tokenizer.ggml.tokens":
                value = value + [f"[PAD{i}]" for i in range(SMOLLM_VOCAB, d["vocab"])]
            elif key == "tokenizer.ggml.token_type":
                value = value + [5] * pad  # unused
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub)


def runtime_floor(path: Path) -> tuple[int, int]:
    """RSS of a bare node, a process that imported what a node imports and built the model on
    the meta device (no weights): (a tail's, a head's, which holds the tokenizer too)."""
    out = subprocess.run([sys.executable, "-c", FLOOR.format(path=str(path))], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    tail, head = out.stdout.strip().splitlines()[-1].split()
    return int(tail), int(head)


def split(path: Path, nodes: int, how: str) -> list:
    """The shards of ``nodes`` nodes: ``balanced`` as ``meshnet up`` splits (the ends of the
    model, which hold more, take fewer layers), or ``even``."""
    import torch

    from fabric.cli.memory_plan import balanced_shards
    from fabric.compute.models import default_cache_root, load_config, resolve
    from fabric.wire.shard import even_split

    source = resolve(str(path))
    config = load_config(source, default_cache_root())
    if how == "even":
        return even_split(config.num_hidden_layers, nodes)
    return balanced_shards(source, config, nodes, torch.bfloat16, "gguf")  # the default mode's


def shares(path: Path, shards: list) -> list[int]:
    """Bytes of the file each node reads (its layers, and the embedding or the final norm and
    lm_head where it holds the first or last layer)."""
    from fabric.compute.gguf_load import GGUFTensors, wanted
    from fabric.compute.models import load_config, resolve

    config = load_config(resolve(str(path)))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = GGUFTensors.open(path)
    return [sum(t.nbytes for t in tensors.infos if wanted(t.name, shard, tied)) for shard in shards]


def run_split(path: Path, shards: list, tokens: int) -> dict:
    """Load time, per-node RSS after a generation, and one stream's decode tok/s."""
    from fabric import Client

    nodes = len(shards)
    with tempfile.TemporaryDirectory() as tmp:
        began = time.monotonic()
        procs, tracker = start_cluster(str(path), nodes, Path(tmp), shards=shards,
                                        ready_s=1200)  # a 1.7B node loads in 4-5 min on a loaded 2-core machine
        loaded = time.monotonic() - began
        try:
            stamps = []
            with Client(tracker, timeout=600) as client:
                for event in client.generate(path.stem, prompt="The history of the", max_tokens=tokens,
                                             ignore_eos=True):
                    if event.event == "token":
                        stamps.extend([time.monotonic()] * len(event.token_ids))
            busy = [memory(p)[0] for p in procs[1:]]  # as the request ends
            time.sleep(IDLE_TRIM_S + 1)  # idle: each node hands back what the request freed
            rss = [memory(p)[0] for p in procs[1:]]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    return {"nodes": nodes, "shards": shards, "load_s": loaded, "rss": rss, "busy": busy,
            "tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def llama_cpp(path: Path, tokens: int) -> dict | None:
    """llama.cpp's decode tok/s and RSS on the file, one process, this machine's cores."""
    code = f"""
import time, psutil
from llama_cpp import Llama
llm = Llama(model_path={str(path)!r}, n_threads={os.cpu_count()}, n_ctx=512, verbose=False)
stamps = []
for out in llm.create_completion("The history of the", max_tokens={tokens}, temperature=0.0, stream=True):
    stamps.append(time.monotonic())
print(len(stamps), (len(stamps) - 1) / (stamps[-1] - stamps[0]), psutil.Process().memory_info().rss)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        print(f"llama.cpp: skipped ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'failed'})")
        return None
    n, tps, rss = out.stdout.split()
    return {"tokens": int(n), "tok_s": float(tps), "rss": int(rss)}


def _mean(before: dict | None, after: dict | None) -> dict | None:
    """llama.cpp's figures measured before and after meshnet's, averaged (each printed)."""
    if before is None or after is None:
        return before or after
    print(f"llama.cpp: {before['tok_s']:.1f} tok/s before meshnet's runs, {after['tok_s']:.1f} after")
    return {"tok_s": (before["tok_s"] + after["tok_s"]) / 2, "rss": max(before["rss"], after["rss"])}


def cpu_features() -> str:
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    return ", ".join(f for f in wanted if f in flags) or "none of AVX2/AVX-512"


def report(path: Path, runs: list[dict], floor: tuple[int, int], ref: dict | None) -> None:
    size = path.stat().st_size
    print(f"file {path.name}: {size / MIB:.0f} MiB; bare node {floor[0] / MIB:.0f} MiB (a head, with its "
          f"tokenizer: {floor[1] / MIB:.0f}); CPU: {cpu_features()}; {os.cpu_count()} cores")
    single = next((r for r in runs if r["nodes"] == 1), None)
    for r in runs:
        share = shares(path, r["shards"])
        above = [(rss - floor[1 if i == 0 else 0]) / s for i, (rss, s) in enumerate(zip(r["rss"], share))]
        print(f"{r['nodes']} node(s) ({', '.join(map(str, r['shards']))}): load {r['load_s']:.1f} s, "
              f"{r['tok_s']:.1f} tok/s"
              + (f" ({r['tok_s'] / ref['tok_s']:.2f}x llama.cpp)" if ref else "")
              + f"; RSS {', '.join(f'{x / MIB:.0f}' for x in r['rss'])} MiB idle"
              + f" ({', '.join(f'{x / MIB:.0f}' for x in r['busy'])} as the request ended)"
              + f"; above a bare node {', '.join(f'{a:.2f}' for a in above)}x its share of the file"
              + (f"; max node {max(r['rss']) / max(single['rss']):.2f}x the single node (as the request ended: "
                 f"{max(r['busy']) / max(single['busy']):.2f}x)" if single else ""))
    if ref:
        print(f"llama.cpp: {ref['tok_s']:.1f} tok/s, RSS {ref['rss'] / MIB:.0f} MiB (the file mapped)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1.7b", choices=[*SHAPES, "gemma3-270m"])
    parser.add_argument("--file", type=Path, default=None, help="measure this GGUF instead of writing one")
    parser.add_argument("--nodes", default="1,2,3", help="node counts to split over (comma-separated)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--keep", type=Path, default=None, help="write the file here and keep it")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--split", default="balanced", choices=["balanced", "even"],
                        help="layers per node: balanced by memory as `meshnet up` splits, or even (default %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file
        if path is None:
            path = (args.keep or Path(tmp)) / f"synthetic-{args.shape}.gguf"
            if not path.is_file():
                began = time.monotonic()
                path.parent.mkdir(parents=True, exist_ok=True)
                write_file(path, args.shape)
                print(f"wrote {path} in {time.monotonic() - began:.0f} s")
        floor = runtime_floor(path)
        before = None if args.no_llama_cpp else llama_cpp(path, args.tokens)
        runs = [run_split(path, split(path, int(n), args.split), args.tokens) for n in args.nodes.split(",")]
        after = None if before is None else llama_cpp(path, args.tokens)  # before and after: the machine drifts
        report(path, runs, floor, _mean(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
