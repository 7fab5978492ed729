#!/usr/bin/env python
"""A batch-8 decode step of a 2-node split, computed in one process, against transformers'.

    python bench/batch_step.py [--model smollm2-135m] [--context 40,1000] [--steps 40] [--threads 2]

No sockets: the two halves of the model (``ShardExecutor`` over layers 0..n/2-1 and
n/2..n-1) decode 8 sessions as one batch, their KV kept as rows of the batch group, and
transformers' model decodes the same 8 prompts as one left-padded batch with its
``DynamicCache``. The two alternate step by step, so both see the same machine; the
figure is the median step time of each after 5 warm-up steps, and their ratio. Prompts are
``--context`` tokens long (8 lengths from there up), so the ratio shows what each step
costs beside the weights: transformers' cache copies every layer's whole cache at each
step (``torch.cat``), the batch group appends one column in place.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fabric.compute.executor import ShardExecutor, Step  # noqa: E402
from fabric.compute.kv import KVStore  # noqa: E402
from fabric.compute.models import load_config, load_shard, resolve  # noqa: E402
from fabric.wire.shard import Shard  # noqa: E402

BATCH = 8


def halves(model: str) -> list[ShardExecutor]:
    source = resolve(model)
    layers = load_config(source).num_hidden_layers
    half = layers // 2
    return [ShardExecutor(load_shard(source, shard, progress=False), KVStore())
            for shard in (Shard(0, half - 1, layers), Shard(half, layers - 1, layers))]


def measure(model: str, hops: list[ShardExecutor], lm, context: int, steps: int) -> tuple[float, float]:
    """Median seconds per batch-8 step: the split's, transformers'."""
    prompts = [[(7 * j + i) % 20000 + 100 for j in range(context + 3 * i)] for i in range(BATCH)]
    names = [f"c{context}-{i}" for i in range(BATCH)]
    tokens, pos = [], []
    for name, prompt in zip(names, prompts):
        x = torch.tensor([prompt])
        for hop in hops:
            x = hop.run(name, hop.w.shard.start, hop.w.shard.end, x, 0)
            x = x.hidden if x.hidden is not None else x.logits
        tokens.append(int(x.argmax()))
        pos.append(len(prompt))
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    ours, theirs = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        x = [torch.tensor([[t]]) for t in tokens]
        for hop in hops:
            out_ = hop.run_batch([Step(n, hop.w.shard.start, hop.w.shard.end, xi, p) for n, xi, p in zip(names, x, pos)])
            x = [r.hidden if r.hidden is not None else r.logits for r in out_]
        t1 = time.perf_counter()
        tokens, pos = [int(r.argmax()) for r in x], [p + 1 for p in pos]
        with torch.inference_mode():
            mask = torch.cat([mask, torch.ones((BATCH, 1), dtype=mask.dtype)], 1)
            out = lm(input_ids=nxt, attention_mask=mask, cache=cache, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
        if step >= 5:
            ours.append(t1 - t0)
            theirs.append(t2 - t1)
    for name in names:
        for hop in hops:
            hop.free_row(name)
            hop.kv.drop(name)
    return statistics.median(ours), statistics.median(theirs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", default="40,1000", help="prompt lengths to measure at (default %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per context (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    hops = halves(args.model)
    source = resolve(args.model)
    lm = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.gguf_file,
                                              dtype=torch.float32).eval()
    print(f"batch-8 decode step, {args.model} float32, {args.threads} threads: a 2-node split in one process "
          f"against transformers' batch of 8")
    for context in (int(c) for c in args.context.split(",")):
        ours, theirs = measure(args.model, hops, lm, context, args.steps)
        print(f"  context {context:5d}: split {1e3 * ours:6.1f} ms  transformers {1e3 * theirs:6.1f} ms  "
              f"= {ours / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
