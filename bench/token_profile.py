"""Where one default-mode decode token goes: torch.profiler over one node holding every layer.

Loads the whole model in the default mode (``--quant auto``, one executor, no sockets),
prefills a prompt, then profiles ``--tokens`` greedy one-token steps and sorts the time of
every torch operator into the weight-only matmul kernels (int4, int8), the attention kernel
(the C call) and everything else (Python, dispatch, norms, rotary, cache writes). Prints
milliseconds per token for each part, and the wall time per token without the profiler.

    python bench/token_profile.py --threads 1
    python bench/token_profile.py --threads 2
    python bench/token_profile.py --modules              # transformers' modules, as before the lean layers
    python bench/token_profile.py --compare 4            # lean against modules, CPU ms/token, alternated
    python bench/token_profile.py --q8dot 6 --threads 2  # torch's kernels against MESHNET_Q8DOT=1, alternated
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

ATTENTION = "meshnet attention (C kernel and its set-up)"
Q8DOT = "meshnet q8dot matmul (C kernel and its call)"
PARTS = {
    "int4 matmul": ("aten::_weight_int4pack_mm_for_cpu",),
    "int8 matmul": ("aten::_weight_int8pack_mm",),
}


def _timed_attention() -> None:
    """The C attention call is no torch operator: label it so the profiler sees it."""
    from fabric.compute import attention

    inner = attention._native

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION):
            return inner(*args, **kwargs)

    attention._native = labelled


def _timed_q8dot() -> None:
    """The q8dot kernel (``MESHNET_Q8DOT=1``) is no torch operator either: label its calls
    (before the model loads: the lean layers keep the bound method)."""
    from fabric.compute.q8dot import DotLinear

    inner = DotLinear.forward

    def labelled(self, x):
        with torch.profiler.record_function(Q8DOT):
            return inner(self, x)

    DotLinear.forward = labelled


def load(model: str):
    from fabric.compute.executor import ShardExecutor
    from fabric.compute.kv import KVStore
    from fabric.compute.models import load_config, load_shard, pick_quant, resolve
    from fabric.wire.shard import Shard

    source = resolve(model)
    layers = load_config(source).num_hidden_layers
    scheme, _ = pick_quant("auto", source)
    return ShardExecutor(load_shard(source, Shard(0, layers - 1, layers), progress=False, quant=scheme), KVStore())


def decode(ex, session: str, logits: torch.Tensor, pos: int, tokens: int) -> torch.Tensor:
    last = ex.w.shard.num_layers - 1
    for p in range(pos, pos + tokens):
        logits = ex.run(session, 0, last, logits.argmax().view(1, 1), p).logits
    return logits


def compare(ex, rounds: int, tokens: int) -> None:
    """Lean layers against transformers' modules in one process, alternated: CPU ms per token
    (the thread's own time: what other tenants take is not counted)."""
    stack, last = ex._lean, ex.w.shard.num_layers - 1
    ids = torch.randint(100, 20000, (1, 100), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {"lean": [], "modules": []}
    for r in range(rounds):
        for name in ("lean", "modules") if r % 2 == 0 else ("modules", "lean"):
            ex._lean = stack if name == "lean" else None
            logits = ex.run(f"{name}{r}", 0, last, ids, 0).logits
            t = time.thread_time()
            decode(ex, f"{name}{r}", logits, 100, tokens)
            times[name].append((time.thread_time() - t) / tokens * 1e3)
    ex._lean = stack
    ratios = sorted(m / lean for lean, m in zip(times["lean"], times["modules"]))
    print(f"CPU ms/token, {rounds} rounds alternated: lean {times['lean']}, modules {times['modules']}; "
          f"modules / lean median {ratios[len(ratios) // 2]:.2f}x")


def against_q8dot(model: str, rounds: int, tokens: int) -> None:
    """The default mode on torch's kernels and on the q8dot kernel (``MESHNET_Q8DOT=1``), two
    executors in one process, alternated: wall and CPU (process) ms per decode token, and the
    greedy tokens' agreement."""
    executors = {}
    for name, switch in (("torch", "0"), ("q8dot", "1")):
        os.environ["MESHNET_Q8DOT"] = switch
        executors[name] = load(model)
    os.environ.pop("MESHNET_Q8DOT")
    ids = torch.randint(100, 20000, (1, 100), generator=torch.Generator().manual_seed(0))
    wall: dict[str, list[float]] = {"torch": [], "q8dot": []}
    cpu: dict[str, list[float]] = {"torch": [], "q8dot": []}
    picked: dict[str, list[int]] = {}
    for r in range(rounds):
        for name in ("torch", "q8dot") if r % 2 == 0 else ("q8dot", "torch"):
            ex = executors[name]
            last = ex.w.shard.num_layers - 1
            logits = ex.run(f"r{r}", 0, last, ids, 0).logits
            t, c = time.perf_counter(), time.process_time()
            seq = []
            for p in range(100, 100 + tokens):
                token = logits.argmax().view(1, 1)
                seq.append(token.item())
                logits = ex.run(f"r{r}", 0, last, token, p).logits
            wall[name].append((time.perf_counter() - t) / tokens * 1e3)
            cpu[name].append((time.process_time() - c) / tokens * 1e3)
            picked[name] = seq
    same = next((i for i, (a, b) in enumerate(zip(picked["torch"], picked["q8dot"])) if a != b), tokens)
    for name in wall:
        print(f"{name:6} wall ms/token {[round(v, 2) for v in wall[name]]} median {statistics.median(wall[name]):.2f}; "
              f"CPU {statistics.median(cpu[name]):.2f}")
    ratios = [t / q for t, q in zip(wall["torch"], wall["q8dot"])]
    print(f"torch / q8dot, wall, median of {rounds} rounds: {statistics.median(ratios):.2f}x; "
          f"greedy tokens agree for the first {same} of {tokens}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=100, help="prompt length before the timed steps")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modules", action="store_true", help="run transformers' modules, not the lean layers")
    parser.add_argument("--compare", type=int, default=0, metavar="ROUNDS",
                        help="only compare lean layers with the modules, CPU time, this many rounds (1 thread)")
    parser.add_argument("--q8dot", type=int, default=0, metavar="ROUNDS",
                        help="only compare torch's kernels (MESHNET_Q8DOT=0) with the q8dot kernel, this many rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.q8dot:
        against_q8dot(args.model, args.q8dot, args.tokens)
        return 0
    _timed_attention()
    _timed_q8dot()
    ex = load(args.model)
    if args.compare:
        compare(ex, args.compare, args.tokens)
        return 0
    if args.modules:
        ex._lean = None
    profile(ex, args)
    return 0


def profile(ex, args) -> None:
    """Time ``args.tokens`` decode steps, then profile as many, and print where a token goes."""
    last = ex.w.shard.num_layers - 1
    ids = torch.randint(100, 20000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    logits = ex.run("s", 0, last, ids, 0).logits
    logits = decode(ex, "s", logits, args.prompt, 4)  # warm
    pos = args.prompt + 4
    t, cpu = time.perf_counter(), time.process_time()
    logits = decode(ex, "s", logits, pos, args.tokens)
    wall = (time.perf_counter() - t) / args.tokens * 1e3
    cpu = (time.process_time() - cpu) / args.tokens * 1e3
    pos += args.tokens
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        decode(ex, "s", logits, pos, args.tokens)
        profiled = (time.perf_counter() - t) / args.tokens * 1e3
    ops = {e.key: e.self_cpu_time_total / 1e3 / args.tokens for e in prof.key_averages()}
    counts = {e.key: e.count / args.tokens for e in prof.key_averages()}
    parts = {name: sum(ops.get(k, 0.0) for k in keys) for name, keys in PARTS.items()}
    for name, label in (("attention", ATTENTION), ("q8dot matmul", Q8DOT)):
        parts[name] = next((e.cpu_time_total / 1e3 / args.tokens for e in prof.key_averages() if e.key == label), 0.0)
    parts["everything else"] = profiled - sum(parts.values())
    print(f"{args.model}, default mode, {args.threads} thread(s), {args.tokens} tokens after {args.prompt}:")
    print(f"  wall {wall:.2f} ms/token ({cpu:.2f} CPU ms) without the profiler, {profiled:.2f} with it")
    for name, ms in parts.items():
        print(f"  {name:<14} {ms:6.2f} ms/token")
    print(f"  torch ops per token: {sum(counts.values()):.0f}")
    top = sorted(((ms, k) for k, ms in ops.items() if k not in sum(PARTS.values(), (ATTENTION, Q8DOT))),
                 reverse=True)[:12]
    for ms, k in top:
        print(f"    {k:<40} {ms:6.3f} ms/token  {counts[k]:5.0f} calls/token")


if __name__ == "__main__":
    raise SystemExit(main())
