#!/usr/bin/env python
"""Speculation across hops: one stream's decode speed with drafts (``--speculate on``) against
without (``--speculate off``), paired in one run, on copy-heavy and open prompts.

    python bench/speculative.py [--tiny] [--model REF] [--tokens N] [--reps R] [--delay-ms D]
                                [--nodes N] [--streams S] [--streams-only] [--no-netbed] [--no-loopback]
                                [--quant Q] [--draft MODEL [--draft-quant Q] | --draft-random]
                                [--prompts P,..] [--ahead] [--own-locks] [--json OUT] [--keep-logs]

``--nodes`` nodes (2 by default: a head and a tail, an even share of the layers each, 1 torch
thread), a tracker and a client agent (tests/netbed_client.py), greedy chat requests of
``--tokens`` new tokens:

- loopback: the processes on 127.0.0.1 (tests/cluster.py's ProcessCluster);
- delayed: each process on a host of its own (network namespaces, tests/netbed.py) whose link
  adds ``--delay-ms`` one way (7.5 ms by default: 30 ms round trip from head to tail and back),
  where the machine allows it (root and ``ip netns``; else skipped, and said so).

Each configuration runs twice, a cluster whose head drafts and one whose head does not,
everything else alike; on loopback both are up at once and their runs alternate. Prompts:
``copy`` (repeat a paragraph with one word changed), ``code`` (add a docstring to a function:
the function comes back) and ``chat`` (open text). Decode
tok/s = (tokens - 1) / (last token - first token), client timestamps, median of ``--reps``
runs after a warm-up; the token ids with drafts are compared with those without (greedy: they
must be the same). Ratios are on / off of the same configuration, prompt and run of the script.

``--streams S`` (8 by default; 0: skipped) adds the crowded case on loopback: S concurrent
streams (bench/concurrency.py's prompts, ``--tokens`` each, end of sequence ignored), their
aggregate tok/s. Both clusters stay up and the waves alternate (off then on, on then off), so a
drift of the machine's speed weighs on both; the ratio is the median of the rounds' own ratios.

``--ahead`` compares pipelined speculation instead: both heads draft, and the one "on" sends
each step's successor before its answer comes (``--drafts-ahead on`` against ``off``).
``--own-locks`` gives each node a compute lock of its own, so that the hosts of the delayed bed
compute at once as machines of their own do (each node has one torch thread).

``--draft MODEL`` gives the drafting head a draft model (``meshnet node --draft``) beside prompt
lookup; ``--draft-random`` one of random weights (2 layers, the model's tokenizer: drafts that
are never kept, the lower bound). ``--quant`` is every node's, both modes (``none``: the route
exact, in float32); ``--draft-quant`` the draft's (its file's own grid by default, so an exact
route of a GGUF drafts from the same file on the 4-bit kernel). ``--prompts`` runs only the
named prompts. Each row also gives the share of drafts kept and the tokens per decode trip
(the tracker's counts of the prompt's runs; the crowded case: the share kept, from the
drafting head's counters), and the report the load average (1 minute) over the run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fabric_bench import python_path  # noqa: E402
from bench.netbed import interrupt, log, model_id  # noqa: E402
from tests import netbed  # noqa: E402
from tests.cluster import ProcessCluster, free_port, node_counters  # noqa: E402

PARAGRAPH = ("The river runs past the old mill every spring, carrying snow from the mountains down to the "
             "valley. Children gather on the bridge to watch the water rise, and the miller counts the days "
             "until the wheel can turn again. By summer the river is quiet, and the mill sleeps in the sun.")
FUNCTION = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
PROMPTS = {
    "copy": f"Repeat this paragraph exactly, changing only the word 'river' to 'stream':\n\n{PARAGRAPH}",
    "code": f"Add a docstring to this Python function and return the whole function:\n\n{FUNCTION}",
    "chat": "Explain in a few sentences why the sky is blue.",
}
MODES = ("off", "on")
NODE_NAMES = ("head", "mid", "tail")  # --nodes 2: head and tail; 3: all three; more: n3, n4, ...


def node_names(count: int) -> list[str]:
    return [NODE_NAMES[0], *NODE_NAMES[1:count - 1], *(f"n{i}" for i in range(3, count)), NODE_NAMES[-1]][:count]


def measure(agents: dict, model: str, tokens: int, reps: int, prompts=tuple(PROMPTS)) -> dict:
    """Per mode (``agents``: mode -> an Agent of its cluster) and prompt: the median decode tok/s
    of ``reps`` runs after a warm-up, and its token ids; with drafts, the share of drafts kept
    and the tokens per trip (the tracker's counts, every run of the prompt). With both modes'
    clusters up, each run of one is followed by one of the other (off first, then on first), so
    a drift of the machine's speed weighs on both."""
    out = {mode: {} for mode in agents}
    for name, text in PROMPTS.items():
        if name not in prompts:
            continue
        runs, ids, before = {mode: [] for mode in agents}, {}, drafts_so_far(agents.get("on"), model)
        for rep in range(reps + 1):
            for mode in (list(agents) if rep % 2 else list(agents)[::-1]):
                events = list(agents[mode].generate(model, [{"role": "user", "content": text}], tokens, timeout=300))
                got = [t for e in events if e["event"] == "token" for t in e["ids"]]
                times = [e["t"] for e in events if e["event"] == "token" and e["ids"]]
                ids[mode] = ids.get(mode) or got
                if rep and len(times) > 1:
                    runs[mode].append((len(got) - 1) / (times[-1] - times[0]))
        for mode in agents:
            out[mode][name] = {"tok_s": statistics.median(runs[mode]), "runs": runs[mode], "ids": ids[mode],
                               "tokens": len(ids[mode])}
        if "on" in agents:
            out["on"][name] |= drafts_since(agents["on"], model, before, reps + 1)
    return out


def drafts_so_far(agent, model: str) -> tuple[int, int, int, int]:
    """(requests, trips, drafted, kept) the tracker has counted for ``model``, every route."""
    if agent is None:
        return 0, 0, 0, 0
    rows = agent.status().get("speculation", {}).get(model, [])
    return tuple(sum(r[k] for r in rows) for k in ("requests", "trips", "drafted", "kept"))


def drafts_since(agent, model: str, before: tuple, requests: int) -> dict:
    """The share of drafts kept and the tokens per trip of the ``requests`` since ``before``
    (their final reports reach the tracker after their last token: waited for, 10 s at most)."""
    deadline = time.monotonic() + 10
    while (now := drafts_so_far(agent, model))[0] - before[0] < requests and time.monotonic() < deadline:
        time.sleep(0.2)
    trips, drafted, kept = (a - b for a, b in zip(now[1:], before[1:]))
    return {"acceptance": kept / drafted if drafted else None,
            "tokens_per_trip": (trips + kept) / trips if trips else None}


def loopback(model: str, layers: list[str], work: Path, cache: Path, args) -> dict:
    """Both modes' clusters on loopback at once, driven by a client agent each: {mode: figures}."""
    clusters, agents = {}, {}
    try:
        for mode in MODES:
            (work / mode).mkdir(parents=True, exist_ok=True)
            cluster = clusters[mode] = ProcessCluster(work / mode, cache)
            names = start_nodes(cluster, model, layers, mode, args)
            client_log = open(work / mode / "client.log", "ab")
            proc = subprocess.Popen([sys.executable, "-m", "tests.netbed_client", "--tracker", cluster.endpoint],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=client_log, cwd=REPO,
                                    env={**os.environ, "PYTHONPATH": python_path()})
            client_log.close()
            agents[mode] = netbed.Agent(proc, cluster.logs)
            agents[mode].wait_nodes(names, model_id(model), timeout=600, procs=cluster.procs)
        return measure(agents, model_id(model), args.tokens, args.reps, args.prompts)
    finally:
        for agent in agents.values():
            agent.close()
        for cluster in clusters.values():
            cluster.close()


def start_nodes(cluster: ProcessCluster, model: str, layers: list[str], mode: str, args,
                metrics: dict | None = None) -> list[str]:
    """The route's nodes; with ``metrics``, each serves /metrics on a port noted there by name."""
    names = node_names(len(layers))
    for name, span in zip(names, layers):
        extra = ()
        if metrics is not None:
            metrics[name] = free_port()
            extra = ("--metrics-port", str(metrics[name]))
        cluster.start_node(name, model, span, None, *node_flags(name, mode, args), *extra)
    return names


def node_flags(name: str, mode: str, args) -> tuple[str, ...]:
    """A node's flags in ``mode``: every node's ``--quant``; the drafting head gets the draft
    model, if any, on its ``--draft-quant``."""
    with_draft = (("--draft", args.draft, "--draft-quant", args.draft_quant)
                  if args.draft and mode == "on" and name == NODE_NAMES[0] else ())
    speculate = ("--speculate", "on", "--drafts-ahead", mode) if args.ahead else ("--speculate", mode)
    own_lock = ("--compute-lock", f"{tempfile.gettempdir()}/meshnet-bench-{os.getpid()}-{name}.lock") \
        if args.own_locks else ()
    return (*speculate, "--audit-rate", "0", "--quant", args.quant, *with_draft, *own_lock)


def random_draft(model: str, directory: Path, cache: Path) -> str:
    """A 2-layer model of random weights with ``model``'s tokenizer: a draft that is never right."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fabric.compute.models import load_tokenizer, resolve

    tokenizer = load_tokenizer(resolve(model), cache / "meshnet")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def counters(ports: dict) -> dict:
    """What the crowded case's nodes counted: the head's drafts, and each node's hops and batches."""
    wanted = ("spec_trips", "spec_drafted", "spec_kept", "hops", "batched_hops", "riding_chunks", "rolled_back")
    return {name: {k: v for k, v in node_counters(port).items() if k in wanted} for name, port in ports.items()}


def crowded(model: str, layers: list[str], work: Path, cache: Path, args) -> dict:
    """``args.streams`` concurrent streams on two loopback clusters, one drafting and one not,
    both up: waves alternate off, on (a warm-up round first). Aggregate tok/s per round."""
    clusters, ports = {}, {mode: {} for mode in MODES}
    try:
        for mode in MODES:
            (work / f"streams-{mode}").mkdir(parents=True, exist_ok=True)
            cluster = clusters[mode] = ProcessCluster(work / f"streams-{mode}", cache)
            names = start_nodes(cluster, model, layers, mode, args, ports[mode])
            cluster.wait_nodes(names, model_id(model), timeout=600)
        rounds = []
        for rep in range(args.reps + 1):
            order = MODES if rep % 2 else MODES[::-1]  # off first, then on first: a trend weighs on both
            figures = {mode: wave(clusters[mode].endpoint, model_id(model), args.streams, args.tokens)
                       for mode in order}
            log(f"{args.streams} streams, round {rep}: " + ", ".join(f"{m} {t:.1f} tok/s" for m, t in figures.items()))
            if rep:
                rounds.append(figures)
        seen = {mode: counters(ports[mode]) for mode in MODES}
        log(f"{args.streams} streams, counters: {json.dumps(seen)}")
        return {"rounds": rounds, "counters": seen, "ratio": statistics.median(r["on"] / r["off"] for r in rounds),
                "off_tok_s": statistics.median(r["off"] for r in rounds),
                "on_tok_s": statistics.median(r["on"] for r in rounds)}
    finally:
        for cluster in clusters.values():
            cluster.close()


def wave(tracker: str, model: str, streams: int, tokens: int) -> float:
    """Aggregate tok/s of ``streams`` concurrent greedy generations of ``tokens`` each."""
    from bench.concurrency import PROMPTS as CHAT, at_once
    from fabric import Client

    counts = [0] * streams

    def one(i: int) -> None:
        with Client(tracker, timeout=300) as client:
            for event in client.generate(model, messages=[{"role": "user", "content": CHAT[i % len(CHAT)]}],
                                         max_tokens=tokens, ignore_eos=True):
                counts[i] += len(event.token_ids)

    elapsed = at_once(one, streams)  # first: the counts are the threads' once they are done
    return sum(counts) / elapsed


def delayed(model: str, layers: list[str], mode: str, work: Path, cache: Path, args) -> dict:
    with netbed.Netbed(work, cache) as bed:
        names = node_names(len(layers))
        for host in ("tracker", *names, "client"):
            bed.add_host(host, delay=args.delay_ms / 1000)
        bed.start_tracker("tracker")
        for name, span in zip(names, layers):
            bed.start_node(name, model, span, *node_flags(name, mode, args))
        with bed.client("client", timeout=300) as agent:
            agent.wait_nodes(names, model_id(model), timeout=600, procs=bed.procs)
            result = measure({mode: agent}, model_id(model), args.tokens, args.reps, args.prompts)[mode]
        result["delay_by"] = "netem" if bed.netem else "delay proxy"
        return result


def layer_spans(model: str, cache: Path, nodes: int) -> list[str]:
    from fabric.compute.models import load_config, resolve
    from fabric.wire.shard import even_split

    num_layers = load_config(resolve(model), cache / "meshnet").num_hidden_layers
    return [f"{s.start}-{s.end}" for s in even_split(num_layers, nodes)]


def report(results: dict, args) -> dict:
    rows = {}
    print(f"\nmodel {args.model_label}, {args.tokens} new tokens, median of {args.reps} runs, "
          f"{args.nodes} nodes x 1 thread, load {min(args.loads):.2f}-{max(args.loads):.2f} during the run\n")
    print(f"{'configuration':<30}{'prompt':<7}{'tokens':>7}{'off tok/s':>10}{'on tok/s':>10}{'on/off':>8}"
          f"{'kept':>6}{'tok/trip':>9}  ids")
    for config, modes in results.items():
        if config.endswith("streams"):
            head = modes["counters"]["on"].get(NODE_NAMES[0], {})
            drafted, kept = head.get("spec_drafted", 0), head.get("spec_kept", 0)  # the head's, warm-up included
            rows[config] = {k: modes[k] for k in ("off_tok_s", "on_tok_s", "ratio")} | {
                "same_ids": True, "acceptance": kept / drafted if drafted else None, "tokens_per_trip": None,
                "drafted": drafted, "rounds": [r["on"] / r["off"] for r in modes["rounds"]]}
            print(f"{config:<30}{'mixed':<7}{args.tokens:>7}{modes['off_tok_s']:>10.2f}{modes['on_tok_s']:>10.2f}"
                  f"{modes['ratio']:>8.2f}{_share(rows[config]['acceptance']):>6}"
                  f"{_share(rows[config]['tokens_per_trip']):>9}  (aggregate; median of the rounds' ratios "
                  f"{', '.join(f'{r:.2f}' for r in rows[config]['rounds'])}; {drafted} drafts sent)")
            continue
        for prompt in args.prompts:
            off, on = modes["off"][prompt], modes["on"][prompt]
            row = {"off_tok_s": off["tok_s"], "on_tok_s": on["tok_s"], "ratio": on["tok_s"] / off["tok_s"],
                   "tokens": off["tokens"], "same_ids": on["ids"] == off["ids"],
                   "acceptance": on.get("acceptance"), "tokens_per_trip": on.get("tokens_per_trip")}
            rows[f"{config} {prompt}"] = row
            print(f"{config:<30}{prompt:<7}{row['tokens']:>7}{row['off_tok_s']:>10.2f}{row['on_tok_s']:>10.2f}"
                  f"{row['ratio']:>8.2f}{_share(row['acceptance']):>6}{_share(row['tokens_per_trip']):>9}"
                  f"  {'same' if row['same_ids'] else 'DIFFER'}")
    print()
    return rows


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model reference (default %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a 6-layer random llama (tests/tiny_models.py) instead")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run (default %(default)s)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per prompt (default %(default)s)")
    parser.add_argument("--delay-ms", type=float, default=7.5,
                        help="one-way delay of each host's link in the delayed bed; head to tail and back crosses "
                             "four (default %(default)s: a 30 ms round trip)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the route, an even split (default %(default)s)")
    parser.add_argument("--streams", type=int, default=8,
                        help="concurrent streams of the crowded case on loopback; 0: skipped (default %(default)s)")
    parser.add_argument("--streams-only", action="store_true", help="only the crowded case")
    parser.add_argument("--no-netbed", action="store_true", help="loopback only")
    parser.add_argument("--no-loopback", action="store_true", help="the delayed bed only")
    parser.add_argument("--draft", default="", help="a draft model for the drafting head (meshnet node --draft)")
    parser.add_argument("--quant", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                        help="every node's --quant, both modes (none: exact, float32) (default %(default)s)")
    parser.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                        help="the drafting head's --draft-quant (default %(default)s: the draft file's own grid)")
    parser.add_argument("--draft-random", action="store_true",
                        help="a draft model of random weights with the model's tokenizer (the lower bound)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), type=lambda v: tuple(v.split(",")),
                        help="prompts to run, of %(default)s")
    parser.add_argument("--ahead", action="store_true",
                        help="compare pipelined speculation instead: both heads draft, and 'on' sends steps ahead of "
                             "their answer (--drafts-ahead on against off)")
    parser.add_argument("--own-locks", action="store_true",
                        help="each node a compute lock of its own, as on machines of their own (by default the nodes "
                             "of this machine take turns, however their hosts are named)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory (logs) and print it")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    work = Path(tempfile.mkdtemp(prefix="meshnet-speculative-bench-"))
    cache = work / "xdg-cache"
    cache.mkdir()
    try:
        return run(args, work, cache)
    finally:
        if args.keep_logs:
            print(f"logs in {work}", file=sys.stderr)
        else:
            subprocess.run(["rm", "-rf", str(work)], check=False)


def stage(args, what: str) -> None:
    """Say what starts, with the machine's load average (1 minute), kept for the report."""
    args.loads = [*getattr(args, "loads", []), os.getloadavg()[0]]
    log(f"{what} (load {args.loads[-1]:.2f})")


def run(args, work: Path, cache: Path) -> int:
    model = args.model
    if args.tiny:
        from tests.tiny_models import make_model

        model = str(make_model("llama", work / "tiny-llama"))
    args.model_label = "tiny random llama (6 layers)" if args.tiny else model
    if unknown := set(args.prompts) - set(PROMPTS):
        log(f"no such prompt: {', '.join(sorted(unknown))} (of {', '.join(PROMPTS)})")
        return 2
    if args.draft_random:
        args.draft = random_draft(model, work / "random-draft", cache)
    args.model_label += f", --quant {args.quant}" if args.quant != "auto" else ""
    args.model_label += "; off and on: --drafts-ahead, both drafting" if args.ahead else ""
    if args.draft:
        args.model_label += (f", draft {'of random weights' if args.draft_random else args.draft}"
                             + (f" (--draft-quant {args.draft_quant})" if args.draft_quant != "auto" else ""))
    layers = layer_spans(model, cache, args.nodes)
    results = {}
    if not args.streams_only and not args.no_loopback:
        stage(args, "loopback, speculation off and on alternating")
        results["loopback"] = loopback(model, layers, work / "loopback", cache, args)
    if args.streams:
        stage(args, f"loopback, {args.streams} streams, speculation off and on alternating")
        results[f"loopback {args.streams} streams"] = crowded(model, layers, work, cache, args)
    reason = "--no-netbed" if args.no_netbed or args.streams_only else netbed.unavailable()
    if reason:
        log(f"no delayed bed: {reason}")
    else:
        name = f"{4 * args.delay_ms:g} ms round trip" + (f", {args.nodes} nodes" if args.nodes != 2 else "")
        results[name] = {}
        for mode in MODES:
            stage(args, f"{name}, speculation {mode}")
            results[name][mode] = delayed(model, layers, mode, work / f"delayed-{mode}", cache, args)
    stage(args, "done")
    rows = report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model_label, "tokens": args.tokens, "reps": args.reps,
                                               "loads": args.loads, "figures": rows}, indent=2))
    return 0 if all(r["same_ids"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
