#!/usr/bin/env python
"""Long prompts on two `meshnet node` processes started by hand on one machine.

    python bench/standalone_nodes.py [--model smollm2-135m] [--prompts 786,1552,3200] [--timeout 30]
        [--rounds 2 --node-args "" --node-args "--compute-lock none"]

Starts a tracker and two standalone nodes (``python -m fabric.cli node``, the model's layers
split in half, every core each, no flag but ``--node-args``), as a user starting them one by
one would. Then, for each prompt length (tokens after the chat template), one greedy request
of ``--max-tokens`` through ``fabric.Client`` with the client's timeout (30 s, its default):
the seconds to the first token and to the end, the progress events the head sent, or the
error that ended the request. With two ``--node-args``, each round runs both settings in
turn and the summary gives the first's time over the second's, per prompt length. Each
prompt starts with its own words, so no request starts from another's kept KV. The nodes run with a runtime directory of their own: their default
compute lock is theirs, not that of other nodes on the machine.

Run it from another checkout (``PYTHONPATH=/that/checkout python bench/standalone_nodes.py``)
to measure that build: the nodes run from the checkout the ``fabric`` package comes from.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fabric
from fabric import Client, FabricError
from fabric.compute.models import load_config, load_tokenizer, resolve

REPO = Path(fabric.__file__).resolve().parent.parent  # the checkout whose nodes run
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps, trimming the "
             "wick, and writing the weather into a leather log that nobody else ever read. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def messages_of(tokenizer, tokens: int, tag: str) -> list[dict]:
    """A user message whose chat-templated prompt has about ``tokens`` tokens."""
    def count(text: str) -> int:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    text = f"Request {tag}. "
    while count(text + PARAGRAPH) <= tokens:
        text += PARAGRAPH
    words = PARAGRAPH.split()
    while count(text + words[0] + " ") <= tokens:
        text += words.pop(0) + " "
    return [{"role": "user", "content": text}]


class Cluster:
    """A tracker and two nodes as processes, logs in ``tmp``."""

    def __init__(self, model: str, tmp: Path, node_args: list[str]):
        self.tracker = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_RUNTIME_DIR": str(tmp / "run")}
        (tmp / "run").mkdir(mode=0o700)
        layers = load_config(resolve(model)).num_hidden_layers
        half = layers // 2
        commands = [["tracker", "--bind", self.tracker, "--pub", f"tcp://127.0.0.1:{free_port()}",
                     "--db", str(tmp / "ledger.sqlite3")]]
        commands += [["node", "--model", model, "--layers", span, "--tracker", self.tracker, "--node-id", name,
                      "--no-progress", *node_args]
                     for name, span in (("head", f"0-{half - 1}"), ("tail", f"{half}-{layers - 1}"))]
        for i, args in enumerate(commands):
            log = open(tmp / f"{i}.log", "wb")
            self.procs.append(subprocess.Popen([sys.executable, "-m", "fabric.cli", "--log-level", "warning", *args],
                                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait(self, model: str) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with Client(self.tracker, timeout=2) as client:
                    if client.status()["plans"].get(model):
                        return
            except FabricError:
                pass
            time.sleep(0.5)
        raise SystemExit("the nodes did not come up")

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def one_request(tracker: str, model: str, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """Seconds to the first token and to the end, progress events, or the error."""
    started, first, progress, tokens, prompt_tokens = time.monotonic(), None, 0, 0, None
    try:
        with Client(tracker, timeout=timeout) as client:
            for event in client.generate(model, messages=messages, max_tokens=max_tokens, ignore_eos=True):
                if event.event == "start":
                    prompt_tokens = event.prompt_tokens
                elif event.event == "progress":
                    progress += 1
                elif event.event == "token":
                    first = first or time.monotonic()
                    tokens += 1
    except FabricError as exc:
        return {"prompt_tokens": prompt_tokens, "error": str(exc),
                "failed_after_s": round(time.monotonic() - started, 2), "load_1min": os.getloadavg()[0]}
    end = time.monotonic()
    return {"prompt_tokens": prompt_tokens, "ttft_s": round(first - started, 2), "total_s": round(end - started, 2),
            "tokens": tokens, "progress_events": progress, "load_1min": os.getloadavg()[0]}


def run_config(args, tokenizer, node_args: str, round_: int) -> list[dict]:
    """One cluster with ``node_args``: a warm-up, then one request per prompt length."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="standalone-") as tmp:
        cluster = Cluster(args.model, Path(tmp), shlex.split(node_args))
        try:
            cluster.wait(args.model)
            one_request(cluster.tracker, args.model, messages_of(tokenizer, 64, "warm-up"), 4, 120)
            for n in map(int, args.prompts.split(",")):
                tag = f"{n}-{os.getpid()}-{round_}-{len(node_args)}"
                row = one_request(cluster.tracker, args.model, messages_of(tokenizer, n, tag), args.max_tokens,
                                  args.timeout)
                rows.append({"round": round_, "node_args": node_args, **row})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            cluster.close()
    return rows


def summary(rows: list[dict], configs: list[str]) -> None:
    """Per prompt length: each config's outcomes, and the first config's time over the second's."""
    for n in sorted({r["prompt_tokens"] for r in rows if r["prompt_tokens"]}):
        mine = [r for r in rows if r["prompt_tokens"] == n]
        for config in configs:
            got = [f"{r['total_s']:.2f} s" if "total_s" in r else f"failed after {r['failed_after_s']:.1f} s"
                   for r in mine if r["node_args"] == config]
            print(f"{n} tokens, nodes {config or '(no flag)'!r}: {', '.join(got)}")
        if len(configs) == 2:
            pairs = [(a["total_s"], b["total_s"]) for a, b in zip(*[[r for r in mine if r["node_args"] == c]
                                                                  for c in configs]) if "total_s" in a and "total_s" in b]
            if pairs:
                ratios = sorted(a / b for a, b in pairs)
                print(f"{n} tokens: {configs[0] or '(no flag)'!r} takes {statistics.median(ratios):.2f}x the time of "
                      f"{configs[1]!r} (rounds {', '.join(f'{x:.2f}x' for x in ratios)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="786,1552,3200", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=30.0, help="the client's timeout (its default: 30 s)")
    ap.add_argument("--node-args", action="append", default=None,
                    help="extra flags for both nodes, e.g. '--compute-lock none'; give it twice to compare two "
                         "settings, run in turn in each round (default: no flag)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    configs = args.node_args or [""]
    tokenizer = load_tokenizer(resolve(args.model))
    rows = [row for round_ in range(1, args.rounds + 1) for config in configs
            for row in run_config(args, tokenizer, config, round_)]
    summary(rows, configs)
    print(json.dumps({"repo": str(REPO), "timeout": args.timeout, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
