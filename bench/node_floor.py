#!/usr/bin/env python
"""Where a node's resident memory goes, stage by stage: one ``meshnet node`` start-up run in this
process, as ``cmd_node`` runs it, with the RSS read after each stage.

    python bench/node_floor.py --model FILE.gguf [--layers A-B] [--tokens 64] [--keep-all]

Stages: the imports ``cmd_node`` makes before torch, torch, the node's config (the model's
config read, no weights), the node package (model classes, transformers' loading code), the
``Node`` (weights, the hop benchmark, a head's tokenizer), and a generation through the shard
(an 8-token prefill and ``--tokens`` decode steps on the executor, no sockets). For each: RSS,
its anonymous part, the growth, the modules loaded, and the threads. At the end the largest
anonymous mappings and glibc's heap, to tell allocator slack from objects.

``--keep-all`` imports what a node left out before (``fabric.cli.torch_env.NOT_IN_A_NODE``), for
a before/after in one run. Figures are one process on a shared machine: RSS is what to trust.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MIB = 2**20


def rollup() -> dict[str, float]:
    """/proc/self/smaps_rollup in MiB."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return out


class Stages:
    """Prints one line per stage: RSS, anonymous, growth since the last stage, modules, threads."""

    def __init__(self):
        self.last = 0.0

    def __call__(self, name: str) -> None:
        r = rollup()
        print(f"{name:34s} RSS {r['Rss']:7.1f} MiB (anon {r['Anonymous']:7.1f})  +{r['Rss'] - self.last:6.1f}  "
              f"modules {len(sys.modules):5d}  threads {len(os.listdir('/proc/self/task'))}", flush=True)
        self.last = r["Rss"]


def mappings(top: int = 8) -> None:
    """The heap and the largest anonymous mappings (size and resident MiB)."""
    rows, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if m:
                cur = [int(m.group(2), 16) - int(m.group(1), 16), 0, m.group(3) or "[anon]"]
                rows.append(cur)
            elif line.startswith("Rss:"):
                cur[1] = int(line.split()[1]) * 1024
    heap = sum(r[1] for r in rows if r[2] == "[heap]")
    anon = sorted((r for r in rows if r[2] == "[anon]"), key=lambda r: -r[1])
    print(f"[heap] {heap / MIB:.1f} MiB resident; largest anonymous mappings (size/resident MiB): "
          + ", ".join(f"{s / MIB:.0f}/{r / MIB:.0f}" for s, r, _ in anon[:top]))


def tensor_bytes() -> tuple[float, float]:
    """MiB of the CPU tensors alive in this process (each storage once): (in memory, file-backed),
    the second being storages over a mapped file (a GGUF's tensors read in place)."""
    import gc

    import torch

    seen, held, mapped = set(), 0, 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".gguf"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            mapped += sum(1 for p in seen if lo <= p < hi)
    return held / MIB, mapped


def generate(node, tokens: int) -> None:
    """An 8-token prefill and ``tokens`` decode steps through the whole shard, as one session."""
    import torch

    ex, shard = node.executor, node.config.shard
    first = shard.is_first
    x = (torch.arange(8)[None] if first else torch.randn(1, 8, ex.hidden_size).to(node.config.dtype))
    ex.run("probe", shard.start, shard.end, x, 0)
    for pos in range(8, 8 + tokens):
        x = torch.tensor([[pos % 100]]) if first else torch.randn(1, 1, ex.hidden_size).to(node.config.dtype)
        ex.run("probe", shard.start, shard.end, x, pos)
    ex.kv.drop("probe")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", default=None, help="inclusive range (default: all)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--keep-all", action="store_true", help="import what a node leaves out (before/after)")
    args = parser.parse_args()
    stage = Stages()
    stage("python")
    from fabric.cli import build_parser, node_command, torch_env

    argv = ["node", "--model", args.model, "--no-progress", "--compute-lock", "none"]
    parsed = build_parser().parse_args(argv + (["--layers", args.layers] if args.layers else ["--layers", "0-0"]))
    if not args.layers:
        parsed.layers = None
    stage("fabric.cli")
    node_command.prepare_process(parsed)
    if args.keep_all:  # undo it: the libraries import what they find, as before
        for name in torch_env.NOT_IN_A_NODE:
            sys.modules.pop(name, None)
    import torch  # noqa: F401

    stage("torch")
    if not args.keep_all:
        torch_env.leave_out_compiler_and_collectives()
    if parsed.layers is None:
        from fabric.compute.models import load_config, resolve

        parsed.layers = f"0-{load_config(resolve(args.model)).num_hidden_layers - 1}"
    config = node_command._node_config(parsed, None)
    stage("node config (no weights)")
    from fabric.node import Node

    stage("fabric.node (model code)")
    node = Node(config)
    stage(f"Node {config.shard} loaded")
    generate(node, args.tokens)
    stage(f"after {args.tokens} decode steps")
    mappings()
    held, mapped = tensor_bytes()
    print(f"CPU tensors alive: {held:.1f} MiB ({mapped} of their storages lie in a mapped GGUF file)")
    left = [name for name in torch_env.NOT_IN_A_NODE if sys.modules.get(name) is not None]
    print(f"loaded of those a node leaves out: {left or 'none'}; threads: {threading.active_count()} Python, "
          f"{len(os.listdir('/proc/self/task'))} in all")
    node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
