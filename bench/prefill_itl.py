#!/usr/bin/env python
"""Inter-token latency of running streams while a long prompt is prefilled, in one run.

    python bench/prefill_itl.py [--model smollm2-135m] [--streams 3] [--prompt-tokens 2000] [--reps 1]
                                [--device cpu|cuda] [--dtype float32|bfloat16]

Starts a tracker and a 2-node split (as ``meshnet up`` would), starts N greedy streams,
and once they are decoding submits one request whose prompt is ``--prompt-tokens`` tokens
long. For the running streams it records the gap between consecutive tokens (client side;
tokens within ``BURST_S`` of each other, the drafts one verification kept, count as one)
and reports the p99 of the gaps that fell while the long prompt was being prefilled
against the median of the gaps outside that window (the streams' own pace; the running
streams ignore end-of-sequence tokens, so they all outlive the prefill). It does this twice
on fresh clusters: with the nodes' default (prefill run in slices riding the streams' decode
passes, each adding about two of their decode steps' time) and with ``--prefill-slice-ms
60000`` (slices that may add a minute: the prompt in one piece, or in a few doubling
slices) as the baseline of the same run. Targets: p99 <= 3x median, and the prompt's
prefill in slices within 1.5x its time in one piece. With ``--reps N`` each of N rounds
runs both, on fresh clusters, back to back; the verdicts are on the medians of the
rounds' own ratios (the machine's speed moves between rounds).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from concurrency import PROMPTS, add_device_args, device_args, start_cluster  # noqa: E402

from fabric import Client
from fabric.compute.models import resolve
from fabric.cli.supervision import stop_processes


BURST_S = 0.002  # tokens of a stream this close together came from one trip (a verification's drafts kept)


def long_prompt(model: str, tokens: int) -> str:
    """Plain text of about ``tokens`` tokens for the model's tokenizer."""
    from fabric.compute.models import load_tokenizer

    tok = load_tokenizer(resolve(model))
    words = ("the fabric passes hidden states from node to node while every stream keeps its pace "
             "and no prompt may stall the others ").split()
    text, n = [], 0
    while n < tokens:
        text.append(words[len(text) % len(words)])
        n = len(tok(" ".join(text))["input_ids"]) if len(text) % 50 == 0 else n
    return " ".join(text)


def run(tracker: str, model: str, streams: int, prompt: str, decode_tokens: int) -> dict:
    times: list[list[float]] = [[] for _ in range(streams)]
    window: dict[str, float] = {}
    warm = threading.Barrier(streams + 1)

    def stream(i: int) -> None:
        with Client(tracker, timeout=300) as client:
            content = f"Write a long, detailed story about this: {PROMPTS[i]}"
            for event in client.generate(model, messages=[{"role": "user", "content": content}],
                                         max_tokens=decode_tokens, ignore_eos=True):
                if event.token_ids:
                    now = time.perf_counter()
                    if times[i] and now - times[i][-1] < BURST_S:
                        continue  # drafted tokens kept by one verification: one delivery, not gaps of 0
                    times[i].append(now)
                    if len(times[i]) == 8:
                        warm.wait(120)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    warm.wait(300)
    with Client(tracker, timeout=300) as client:
        window["start"] = time.perf_counter()
        for event in client.generate(model, prompt=prompt, max_tokens=4):
            if event.token_ids:
                window.setdefault("first_token", time.perf_counter())
                break
    for t in threads:
        t.join()
    gaps_outside, gaps_during = [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            during = b > window["start"] and a < window["first_token"]
            (gaps_during if during else gaps_outside).append(b - a)
    gaps_during.sort()
    p99 = gaps_during[min(len(gaps_during) - 1, int(0.99 * len(gaps_during)))] if gaps_during else float("nan")
    median = statistics.median(gaps_outside)
    finished = all(ts[-1] > window["first_token"] for ts in times)
    return {"median_ms": median * 1e3, "p99_during_ms": p99 * 1e3, "max_during_ms": max(gaps_during) * 1e3,
            "ratio": p99 / median, "prefill_s": window["first_token"] - window["start"],
            "gaps_during": len(gaps_during), "streams_outlived_prefill": finished}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=3, help="running streams (default %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="length of the long prompt")
    parser.add_argument("--decode-tokens", type=int, default=400,
                        help="tokens each running stream asks for; enough to outlive the prefill")
    parser.add_argument("--reps", type=int, default=1, help="rounds of both settings (default %(default)s)")
    add_device_args(parser)
    args = parser.parse_args()
    prompt = long_prompt(args.model, args.prompt_tokens)
    rounds = [{label: one_cluster(args, prompt, node_args) for label, node_args in MODES} for _ in range(args.reps)]
    report(args, rounds)
    return 0


MODES = (("sliced (default)", ()), ("one piece (--prefill-slice-ms 60000)", ("--prefill-slice-ms", "60000")))


def one_cluster(args, prompt: str, node_args: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        procs, tracker = start_cluster(args.model, 2, Path(tmp), node_args=(*node_args, *device_args(args)))
        try:
            return run(tracker, resolve(args.model).model_id, args.streams, prompt, args.decode_tokens)
        finally:
            stop_processes(procs, grace=30)


def report(args, rounds: list[dict]) -> None:
    print(f"inter-token latency of {args.streams} running streams while a {args.prompt_tokens}-token prompt "
          f"is prefilled ({args.model}, {args.dtype} on {args.device}, 2-node split, {len(rounds)} round(s))")
    for n, results in enumerate(rounds, 1):
        for label, r in results.items():
            print(f"  round {n} {label:34s} median outside {r['median_ms']:6.1f} ms  p99 during prefill "
                  f"{r['p99_during_ms']:7.1f} ms (max {r['max_during_ms']:7.1f}, {r['gaps_during']} gaps)  = "
                  f"{r['ratio']:.2f}x median  prefill took {r['prefill_s']:.1f} s"
                  + ("" if r["streams_outlived_prefill"] else "  (a stream ended before the prefill did)"))
    sliced, whole = (label for label, _ in MODES)
    for label, _ in MODES:
        ratio = statistics.median(r[label]["ratio"] for r in rounds)
        seconds = statistics.median(r[label]["prefill_s"] for r in rounds)
        print(f"  {label:34s} p99 during prefill = {ratio:.2f}x median (median of rounds)  "
              f"[{'PASS' if ratio <= 3 else 'MISS'} <= 3x]  prefill {seconds:.1f} s")
    slower = statistics.median(r[sliced]["prefill_s"] / r[whole]["prefill_s"] for r in rounds)
    print(f"  prefill in slices = {slower:.2f}x in one piece (median of rounds)  [{'PASS' if slower <= 1.5 else 'MISS'}"
          f" <= 1.5x]")


if __name__ == "__main__":
    sys.exit(main())
