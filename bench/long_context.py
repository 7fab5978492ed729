#!/usr/bin/env python
"""Long contexts: time to first token per turn of a chat with a long system prompt, with
KV reuse across requests on and off, paired in one run; then a long prompt prefilled beside
running streams, and the concurrency figures.

    python bench/long_context.py [--model smollm2-135m] [--system-tokens 1200] [--turns 5]
                                 [--reply-tokens 32] [--reps 2] [--device cpu|cuda]
                                 [--dtype float32|bfloat16] [--quant none|auto|int8|int4]
                                 [--parts ttft,prefill,concurrency,speed] [--prompt-tokens 2000]
                                 [--concurrency-reps 3] [--speed-rounds 3] [--speed-prompts 8] [--speed-tokens 64]

Starts two clusters side by side, each a tracker and a 2-node split as ``meshnet up``
starts them (all cores each, one compute lock: here one lock for all four nodes, so the two
clusters take turns and never compute at once): one with the nodes' default KV cache, one
with ``--kv-cache-gib 0`` (no reuse). Each round is a fresh chat (its system prompt opens
with the round's own line, so nothing of an earlier round matches): every turn is asked of
the cluster without reuse and then of the one with it, back to back, with the same messages
(the reply fed to the next turn is the one without reuse). A turn's time to first token
(TTFT) is the client's, from the request to its first token. Then a second chat with the
same system prompt and another question shows what a shared system prompt saves.

Prints the TTFT of each turn, the ratio median(turns 2..N) / turn 1 of each cluster
(target with reuse: <= 0.35), the nodes' reuse counters, and whether both clusters gave
the same tokens.

The other parts run the scripts that measure them, one after the other, each with its
baseline in its own run: ``prefill`` is bench/prefill_itl.py (a ``--prompt-tokens`` prompt
sent while 3 streams decode, in slices against in one piece: how long it took, and the
running streams' inter-token latency p99 during it against their median; targets: sliced
<= 1.5x one piece, p99 <= 3x median); ``concurrency`` is bench/concurrency.py with 1 and 8
streams (targets: 8 streams >= 4x one and >= 0.9x transformers' batch of 8).
``speed`` (on the CPU) is the default mode against exact mode (``bench/default_mode.py``'s speed
part: decode tok/s of the nodes' defaults, a GGUF on its own grid, against ``--quant none
--dtype float32``, paired in interleaved rounds, and their greedy agreement).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from concurrency import add_device_args, device_args, start_cluster  # noqa: E402
from default_mode import report_speed, run_speed  # noqa: E402

from fabric import Client
from fabric.cli.supervision import stop_processes
from fabric.compute.models import load_tokenizer, resolve

HANDBOOK = [
    "You are the support assistant of Harbor Lane Bikes, a shop that sells and repairs bicycles.",
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; the shop is closed on Sundays.",
    "A basic tune-up costs forty dollars and includes brake and gear adjustment, chain cleaning and a safety check.",
    "A full service costs ninety dollars and adds wheel truing, bearing checks and new cables where needed.",
    "Flat tyres are fixed while the customer waits, for twelve dollars plus the price of the tube.",
    "Electric bikes are serviced only by the two certified mechanics, Dana and Luis, on Tuesdays and Thursdays.",
    "Returns are accepted within thirty days with the receipt, if the item is unused and in its packaging.",
    "Bikes bought here get free adjustments for the first six months and a discount of ten percent on parts.",
    "Rentals cost twenty-five dollars a day for a city bike and forty dollars a day for an electric one.",
    "A rental needs a photo identity card and a deposit of two hundred dollars, refunded when the bike returns.",
    "Helmets are lent free with every rental; children under sixteen must wear one at all times.",
    "The shop runs a free maintenance class on the first Monday of every month, from six to eight in the evening.",
    "Answer briefly and politely, quote prices exactly as written here, and never promise a repair date.",
    "If a question is not covered here, offer to pass it to the manager, Priya, who answers within one day.",
]
QUESTIONS = ["How much is a tune-up?", "And a full service?", "Can I rent an electric bike on Sunday?",
             "What do I need to rent one?", "Do you fix flat tyres while I wait?", "When is the next free class?"]
OTHER_CHAT = "Who services electric bikes, and on which days?"


def system_prompt(model: str, tokens: int, round_no: int) -> str:
    """The handbook, repeated to at least ``tokens`` tokens, opening with the round's own line."""
    tok = load_tokenizer(resolve(model))
    lines = [f"Conversation {round_no} of the shop's support desk."]
    while len(tok(" ".join(lines))["input_ids"]) < tokens:
        lines.append(HANDBOOK[(len(lines) - 1) % len(HANDBOOK)])
    return " ".join(lines)


def ask(tracker: str, model: str, messages: list[dict], reply_tokens: int) -> tuple[float, list[int], str]:
    """TTFT in seconds, token ids and text of one greedy request."""
    ids, text, first = [], "", None
    with Client(tracker, timeout=600) as client:
        start = time.perf_counter()
        for event in client.generate(model, messages=messages, max_tokens=reply_tokens):
            if event.token_ids and first is None:
                first = time.perf_counter() - start
            ids.extend(event.token_ids)
            text += event.text
    return first if first is not None else float("nan"), ids, text


def chat_round(trackers: dict[str, str], model: str, system: str, turns: int, reply_tokens: int) -> dict:
    """One chat of ``turns`` turns on both clusters, then another chat with the same system
    prompt. Returns TTFTs per cluster and whether their tokens agreed."""
    ttft = {name: [] for name in trackers}
    same = True
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        replies = {}
        for name, tracker in trackers.items():
            seconds, ids, text = ask(tracker, model, messages, reply_tokens)
            ttft[name].append(seconds)
            replies[name] = (ids, text)
        same &= len({tuple(ids) for ids, _ in replies.values()}) == 1
        messages.append({"role": "assistant", "content": replies["off"][1]})
    other = [{"role": "system", "content": system}, {"role": "user", "content": OTHER_CHAT}]
    shared = {name: ask(tracker, model, other, reply_tokens)[0] for name, tracker in trackers.items()}
    return {"ttft": ttft, "same": same, "shared": shared}


def kv_counters(tracker: str) -> list[dict]:
    with Client(tracker, timeout=10) as client:
        return [n["kv_cache"] | {"id": n["id"]} for n in client.status()["nodes"]]


def report(args, rounds: list[dict], counters: dict[str, list[dict]]) -> None:
    names = {"off": "reuse off (--kv-cache-gib 0)", "on": "reuse on (default)"}
    print(f"TTFT per turn, {args.turns}-turn chat, system prompt >= {args.system_tokens} tokens, {args.reply_tokens}-"
          f"token replies ({args.model}, {args.dtype} on {args.device}, 2-node split, {len(rounds)} rounds)")
    ratios = {}
    for name in ("off", "on"):
        for i, r in enumerate(rounds):
            t = r["ttft"][name]
            ratio = statistics.median(t[1:]) / t[0]
            ratios.setdefault(name, []).append(ratio)
            print(f"  {names[name]:28s} round {i + 1}: " + "  ".join(f"{s:6.2f}" for s in t)
                  + f" s   median(turns 2-{args.turns}) / turn 1 = {ratio:.2f}")
    for name in ("off", "on"):
        ratio = statistics.median(ratios[name])
        verdict = f"  [{'PASS' if ratio <= 0.35 else 'MISS'} <= 0.35]" if name == "on" else ""
        print(f"  {names[name]:28s} ratio (median over rounds) {ratio:.2f}{verdict}")
    for name in ("off", "on"):
        shared = statistics.median(r["shared"][name] for r in rounds)
        first = statistics.median(r["ttft"][name][0] for r in rounds)
        print(f"  {names[name]:28s} another chat, same system prompt: TTFT {shared:.2f} s "
              f"({shared / first:.2f}x turn 1)")
    for name in ("off", "on"):
        for row in counters[name]:
            print(f"  {names[name]:28s} node {row['id']}: {row['hits']} hits, {row['misses']} misses, "
                  f"{row['bytes'] / (1 << 20):.1f} MiB kept")
    same = all(r["same"] for r in rounds)
    print(f"  same tokens with and without reuse: {'yes' if same else 'NO'}")


def other_parts(args) -> None:
    """The prefill and concurrency parts: their own scripts, run here one after the other."""
    parts = {"prefill": ["prefill_itl.py", "--prompt-tokens", str(args.prompt_tokens)],
             "concurrency": ["concurrency.py", "--streams", "1,8", "--reps", str(args.concurrency_reps)]}
    for name, (script, *argv) in parts.items():
        if name in args.parts:
            command = [script, *argv, "--model", args.model, *device_args(args)]
            print(f"\n== {name}: python bench/{' '.join(command)}", flush=True)
            subprocess.run([sys.executable, str(REPO / "bench" / script), *command[1:]], cwd=REPO, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--system-tokens", type=int, default=1200, help="system prompt length (default %(default)s)")
    parser.add_argument("--turns", type=int, default=5, help="turns per chat (default %(default)s)")
    parser.add_argument("--reply-tokens", type=int, default=32, help="max tokens per reply (default %(default)s)")
    parser.add_argument("--reps", type=int, default=2, help="chats, each on both clusters (default %(default)s)")
    parser.add_argument("--parts", default="ttft,prefill,concurrency,speed", type=lambda v: set(v.split(",")),
                        help="which figures: ttft (reuse on and off), prefill (bench/prefill_itl.py), concurrency "
                             "(bench/concurrency.py), speed (default vs exact mode) (default: all)")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the prefill part's long prompt")
    parser.add_argument("--concurrency-reps", type=int, default=3, help="the concurrency part's rounds")
    parser.add_argument("--speed-rounds", type=int, default=3,
                        help="rounds of default vs exact decode speed (default %(default)s)")
    parser.add_argument("--speed-prompts", type=int, default=8, help="prompts per speed round (default %(default)s)")
    parser.add_argument("--speed-tokens", type=int, default=64, help="tokens per speed prompt (default %(default)s)")
    add_device_args(parser)
    args = parser.parse_args()
    if "ttft" in args.parts:
        chats(args)
    other_parts(args)
    if "speed" in args.parts and args.speed_rounds and args.device == "cpu":  # the weight-only kernels are the CPU's
        speed = argparse.Namespace(model=args.model, rounds=args.speed_rounds, prompts=args.speed_prompts,
                                   tokens=args.speed_tokens, threads=0)
        report_speed(speed, run_speed(speed))
    return 0


def chats(args) -> None:
    """The TTFT part: two clusters, reuse off and on, the same chats asked of both."""
    model = resolve(args.model).model_id
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {}
        try:
            for name, extra in (("off", ("--kv-cache-gib", "0")), ("on", ())):
                (Path(tmp) / name).mkdir()
                procs, tracker = start_cluster(args.model, 2, Path(tmp) / name,
                                               node_args=(*extra, *device_args(args), "--compute-lock",
                                                          str(Path(tmp) / "compute.lock")))
                clusters[name] = (procs, tracker)
            trackers = {name: tracker for name, (_, tracker) in clusters.items()}
            rounds = [chat_round(trackers, model, system_prompt(args.model, args.system_tokens, i), args.turns,
                                 args.reply_tokens) for i in range(args.reps)]
            time.sleep(2.5)  # the nodes' next heartbeats carry their counters
            report(args, rounds, {name: kv_counters(tracker) for name, tracker in trackers.items()})
        finally:
            for procs, _ in clusters.values():
                stop_processes(procs, grace=30)


if __name__ == "__main__":
    sys.exit(main())
