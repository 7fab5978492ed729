#!/usr/bin/env python
"""The long-context chat of bench/long_context.py on llama.cpp (llama-cpp-python), with its
prompt cache on and off: the baseline meshnet's KV reuse is compared with.

    python bench/llama_cpp_ttft.py [--model smollm2-135m] [--system-tokens 1200] [--turns 5]
                                   [--reply-tokens 32] [--reps 2] [--threads 2]

Needs ``pip install llama-cpp-python diskcache`` (built from source where no wheel exists).
One ``Llama`` of the same GGUF (its own quantized kernels), the same system prompt and
questions as long_context.py, greedy. With the cache on, one ``Llama`` keeps its KV between
turns and evaluates only what follows the longest common prefix of the last prompt (what
llama-server's ``cache_prompt`` does); off, the KV is reset before each turn. A turn's TTFT
is from the call to its first streamed token. Prints TTFT per turn and median(turns
2..N) / turn 1 of each, as long_context.py does.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from long_context import QUESTIONS, system_prompt  # noqa: E402

from fabric.compute.models import resolve  # noqa: E402


def chat(llm, system: str, turns: int, reply_tokens: int, cache: bool) -> list[float]:
    """TTFT of each turn of one chat."""
    messages, ttft = [{"role": "system", "content": system}], []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        if not cache:
            llm.reset()  # forget the evaluated tokens: the next prompt is computed in full
        start, first, text = time.perf_counter(), None, ""
        for chunk in llm.create_chat_completion(messages=messages, max_tokens=reply_tokens, temperature=0.0,
                                                stream=True):
            delta = chunk["choices"][0]["delta"].get("content")
            if delta and first is None:
                first = time.perf_counter() - start
            text += delta or ""
        ttft.append(first if first is not None else time.perf_counter() - start)
        messages.append({"role": "assistant", "content": text})
    return ttft


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF or its alias (default: %(default)s)")
    parser.add_argument("--system-tokens", type=int, default=1200, help="system prompt length (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=5, help="turns per chat (default: %(default)s)")
    parser.add_argument("--reply-tokens", type=int, default=32, help="tokens per reply (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=2, help="chats per setting, interleaved (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default: %(default)s)")
    args = parser.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        parser.error("llama-cpp-python is not installed (pip install llama-cpp-python diskcache)")
    source = resolve(args.model)
    llm = Llama(model_path=str(source.path), n_ctx=8192, n_threads=args.threads, verbose=False)
    results: dict[str, list[list[float]]] = {"off": [], "on": []}
    for rep in range(args.reps):
        system = system_prompt(args.model, args.system_tokens, rep)
        for name in ("off", "on"):
            llm.reset()  # each chat starts from nothing: an earlier chat's prefix would differ anyway
            results[name].append(chat(llm, system, args.turns, args.reply_tokens, cache=name == "on"))
    print(f"llama.cpp {args.model} ({source.path.name}), {args.system_tokens}-token system prompt, "
          f"{args.turns} turns, {args.threads} threads")
    for name, rounds in results.items():
        for i, ttft in enumerate(rounds, 1):
            ratio = statistics.median(ttft[1:]) / ttft[0]
            print(f"  prompt cache {name:<3} chat {i}: TTFT " + ", ".join(f"{t:.3f}" for t in ttft)
                  + f" s; median(turns 2..{args.turns}) / turn 1 = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
