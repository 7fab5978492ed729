#!/usr/bin/env python
"""Quantized shards (``--quant int8`` / ``int4``): decode tokens/s and greedy agreement, as ratios in one run.

    python bench/quant_bench.py [--model smollm2-135m] [--threads 2] [--tokens 64] [--reps 3]
                                [--configs ...] [--json OUT]

Configurations, each in its own process (so torch threads and memory of one never touch
another), loaded once, then timed in rotating order ``--reps`` times:

- ``hf-float32``, ``hf-bfloat16``: single-process transformers, ``AutoModelForCausalLM`` from
  the same GGUF / directory, greedy ``generate``.
- ``hf-int8``, ``hf-int4``: the same in bfloat16, quantized with ``fabric.compute.quant.quantize``:
  the references a quantized node must match token for token.
- ``node-int8``, ``node-int4``: one fabric node holding every layer, started as users do
  (``python -m fabric.cli tracker`` + ``python -m fabric.cli node ... --quant SCHEME
  --threads T``) and driven with ``fabric.Client.generate``. Used when the CLI offers that
  scheme; otherwise ``executor-SCHEME`` stands in, labelled as such: ``load_shard(...,
  quant=SCHEME)`` and ``ShardExecutor`` driven in a worker process exactly as a head drives
  its own shard (greedy, no sockets).
- ``llama.cpp``: llama-cpp-python on the same GGUF with the same threads, when installed;
  skipped with a note otherwise.
- ``floor-int8``: the int8 kernels alone: every ``Int8Linear`` of ``hf-int8`` (the decoder
  layers' and the lm_head), called in model order on one bfloat16 row per token, and
  nothing else (no norms, rotary, attention, cache or module calls). No kernel-bound node
  decodes faster; against llama.cpp it says how much of the 0.8x target is left for the rest.
- ``compiled-int8`` (not in the default set: minutes to compile): ``hf-int8`` with each
  decoder layer through ``torch.compile`` (inductor, dynamic shapes); compiling happens
  in the warm-up and counts as its load time. Its greedy ids are checked against ``hf-int8``.

Decode tokens/s is timed from the first generated token to the last ((n - 1) / seconds) on
each bench prompt, summed over prompts; the median over the quiet reps (other tenants used
at most 15 % of the CPU) is reported, or over all reps, flagged "noisy", when none was quiet. Beside it: the share of the machine's CPU that other
tenants used during the run, and the CPU time the measured process spent per generated
token (prefill included), which other tenants disturb less than wall time with one thread.
On a shared 2-core machine a busy neighbour halves any figure; with 2 torch threads it can
cost far more, since OpenMP threads spin waiting for a descheduled peer.

Verdicts: ``node-int8 >= 0.8x llama.cpp`` (same for int4) is PASS/MISS only when llama.cpp was
measured in this run. The DESIGN.md figure (llama.cpp about 85 tok/s on the dev machine) is
printed as a labelled reference, never used as a measured baseline. Quality: a node's greedy
token ids on every bench prompt must equal ``hf-SCHEME``'s; agreement with float32 (tokens
before the first difference) is shown for int8, int4 and plain bfloat16.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.fabric_bench import LoadMeter, clock_streamer, python_path  # noqa: E402
from tests.support import free_port  # noqa: E402

PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three good habits for writing Python code?",
)
TARGET = 0.8  # node int8 / llama.cpp
DESIGN_LLAMA_CPP_TPS = 85.0  # DESIGN.md, dev machine, same GGUF, 2 threads: a reference, not a baseline
QUIET = 0.15
ALL_CONFIGS = ("hf-float32", "hf-bfloat16", "hf-int8", "hf-int4", "node-int8", "node-int4", "llama.cpp", "floor-int8")
EXTRA_CONFIGS = ("compiled-int8", "executor-int8", "executor-int4")  # on request only
SCHEMES = ("int8", "int4")


def log(msg: str) -> None:
    print(f"[quant-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workers
# A worker loads one configuration, answers "ready", then runs every bench prompt for
# each "run" line on stdin and answers one JSON line per run.


class HFWorker:
    def __init__(self, source, tokenizer, eos, kind: str):
        import torch
        from transformers import AutoModelForCausalLM

        from fabric.compute.reference import load_quantized_reference

        self.torch = torch
        directory, gguf = str(source.directory), source.gguf_file
        if kind in ("hf-int8", "hf-int4"):
            self.model = load_quantized_reference(directory, gguf_file=gguf, scheme=kind.removeprefix("hf-"))
        else:
            dtype = torch.float32 if kind == "hf-float32" else torch.bfloat16
            self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=dtype).eval()
        self.eos = sorted(eos)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        torch = self.torch
        x = torch.tensor([ids])
        clock = clock_streamer()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                      eos_token_id=self.eos, pad_token_id=self.pad, streamer=clock)
        return out[0, x.shape[1]:].tolist(), clock.times


class CompiledWorker(HFWorker):
    """``hf-int8`` with each decoder layer compiled by ``torch.compile``."""

    def __init__(self, source, tokenizer, eos, kind: str):
        import torch._dynamo

        super().__init__(source, tokenizer, eos, "hf-int8")
        # every layer is its own compiled graph (its own cache objects and index): allow that many
        torch._dynamo.config.recompile_limit = 16 * len(self.model.model.layers)
        for layer in self.model.model.layers:
            layer.forward = self.torch.compile(layer.forward, dynamic=True)


class FloorWorker:
    """The int8 matrix products of one decode token and nothing else, in model order."""

    def __init__(self, source, tokenizer, eos, kind: str):
        import torch

        from fabric.compute.quant import Int8Linear
        from fabric.compute.reference import load_quantized_reference

        self.torch = torch
        model = load_quantized_reference(str(source.directory), gguf_file=source.gguf_file, scheme="int8")
        self.linears = [(m.weight, m.scales) for m in model.modules() if isinstance(m, Int8Linear)]
        self.rows = {n: torch.randn(1, n).to(torch.bfloat16) for n in {w.shape[1] for w, _ in self.linears}}

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        mm, times = self.torch._weight_int8pack_mm, []
        with self.torch.inference_mode():
            for _ in range(n):
                for w, scales in self.linears:
                    mm(self.rows[w.shape[1]], w, scales)
                times.append(time.perf_counter())
        return [0] * n, times  # no tokens: only the time per token means anything


class ExecutorWorker:
    """One node's work without its sockets: the head's greedy loop over its own full shard."""

    def __init__(self, source, tokenizer, eos, kind: str):
        import torch

        from fabric.compute.executor import ShardExecutor
        from fabric.compute.kv import KVStore
        from fabric.compute.models import default_cache_root, load_config, load_shard
        from fabric.wire.shard import Shard

        self.torch = torch
        layers = load_config(source, default_cache_root()).num_hidden_layers
        weights = load_shard(source, Shard(0, layers - 1, layers), quant=kind.removeprefix("executor-"), progress=False,
                             cache_root=default_cache_root())
        self.kv = KVStore(600)
        self.ex = ShardExecutor(weights, self.kv)
        self.last = layers - 1
        self.eos = eos

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        torch = self.torch
        session = uuid.uuid4().hex
        out, times, pos, x = [], [], 0, torch.tensor([ids])
        try:
            while len(out) < n:
                result = self.ex.run(session, 0, self.last, x, pos)
                pos += x.shape[1]
                tok = int(torch.argmax(result.logits))
                out.append(tok)
                times.append(time.perf_counter())
                if tok in self.eos:
                    break
                x = torch.tensor([[tok]])
        finally:
            self.kv.drop(session)
        return out, times


class LlamaCppWorker:
    def __init__(self, source, tokenizer, eos, kind: str, threads: int):
        from llama_cpp import Llama

        if source.kind != "gguf":
            raise RuntimeError("llama.cpp needs a .gguf model")
        self.llm = Llama(model_path=str(source.path), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                         verbose=False)
        self.eos = eos

    def generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        self.llm.reset()
        out, times = [], []
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            times.append(time.perf_counter())
            if tok in self.eos or len(out) >= n:
                break
        return out, times


def worker_main(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from fabric.compute.models import (
        default_cache_root,
        load_config,
        load_tokenizer,
        resolve,
    )
    from fabric.node.route_session import eos_ids

    source = resolve(args.model)
    tokenizer = load_tokenizer(source, default_cache_root())
    eos = set(eos_ids(tokenizer, load_config(source, default_cache_root())))
    t0 = time.perf_counter()
    if args.worker.startswith("hf-"):
        w = HFWorker(source, tokenizer, eos, args.worker)
    elif args.worker == "compiled-int8":
        w = CompiledWorker(source, tokenizer, eos, args.worker)
    elif args.worker == "floor-int8":
        w = FloorWorker(source, tokenizer, eos, args.worker)
    elif args.worker.startswith("executor-"):
        w = ExecutorWorker(source, tokenizer, eos, args.worker)
    elif args.worker == "llama.cpp":
        w = LlamaCppWorker(source, tokenizer, eos, args.worker, args.threads)
    else:
        raise SystemExit(f"unknown worker {args.worker}")
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for p in PROMPTS]
    load_s = time.perf_counter() - t0
    w.generate(prompts[0], 8)  # warm-up
    import psutil

    print(json.dumps({"ready": True, "load_s": load_s, "rss": psutil.Process().memory_info().rss,
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        runs, cpu0 = [], time.process_time()
        for ids in prompts:
            out, times = w.generate(ids, args.tokens)
            runs.append({"ids": out, "decode_s": (times[-1] - times[0]) if len(times) > 1 else 0.0,
                         "decode_tokens": max(0, len(times) - 1)})
        print(json.dumps({"runs": runs, "cpu_s": time.process_time() - cpu0}), flush=True)
    return 0


# --------------------------------------------------------------------------- parent side


def wait_quiet(max_wait: float) -> float:
    """Wait up to ``max_wait`` s for other tenants to use at most QUIET of the machine."""
    deadline = time.monotonic() + max_wait
    while True:
        with LoadMeter() as m:
            time.sleep(1.0)
        if m.foreign <= QUIET or time.monotonic() > deadline:
            return m.foreign


class Procs:
    def __init__(self, logdir: Path):
        self.logdir, self.items = logdir, []

    def start(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        err = open(self.logdir / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, cwd=REPO, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": python_path()}, **kw)
        self.items.append((name, proc))
        return proc

    def tail(self, name: str, lines: int = 12) -> str:
        path = self.logdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        for _, p in self.items:
            if p.poll() is None:
                try:
                    p.terminate()
                except ProcessLookupError:
                    pass
        for _, p in self.items:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Worker:
    def __init__(self, procs: Procs, kind: str, args):
        self.kind = kind
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--model", args.model,
                "--threads", str(args.threads), "--tokens", str(args.tokens)]
        self.proc = procs.start(kind, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs = procs
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} worker exited ({self.proc.poll()}):\n{self.procs.tail(self.kind)}")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    @property
    def pids(self):
        return [self.proc.pid]


def cli_quant_choices() -> str:
    """``meshnet node --help`` text after ``--quant`` ('' when the flag is missing)."""
    out = subprocess.run([sys.executable, "-m", "fabric.cli", "node", "--help"], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": python_path()})
    return out.stdout.partition("--quant")[2]


class NodeCluster:
    """A tracker and one full ``--quant SCHEME`` node, started with the CLI as users do."""

    def __init__(self, procs: Procs, args, tmp: Path, scheme: str):
        self.kind = f"node-{scheme}"
        from fabric.compute.models import default_cache_root, load_config, resolve

        source = resolve(args.model)
        layers = load_config(source, default_cache_root()).num_hidden_layers
        self.model_id = source.model_id
        self.tokens = args.tokens
        me = [sys.executable, "-m", "fabric.cli", "--log-level", "warning"]
        self.tracker = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [
            procs.start(f"{self.kind}-tracker", [*me, "tracker", "--bind", self.tracker, "--pub",
                                                 f"tcp://127.0.0.1:{free_port()}", "--db", str(tmp / f"{scheme}.db")]),
            procs.start(self.kind, [*me, "node", "--model", args.model, "--layers", f"0-{layers - 1}",
                                    "--tracker", self.tracker, "--threads", str(args.threads),
                                    "--quant", scheme, "--no-progress"]),
        ]
        self._procs = procs
        t0 = time.perf_counter()
        self._wait_ready()
        self.info = {"load_s": time.perf_counter() - t0}
        import psutil

        self.info["rss"] = psutil.Process(self.procs[1].pid).memory_info().rss
        self._generate(PROMPTS[0], 8)  # warm-up

    def _wait_ready(self, timeout: float = 600.0) -> None:
        from fabric import Client, FabricError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in zip((f"{self.kind}-tracker", self.kind), self.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self._procs.tail(name)}")
            try:
                with Client(self.tracker, timeout=2.0) as client:
                    plans = client.status().get("plans", {}).get(self.model_id) or []
                if plans:
                    return
            except FabricError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the {self.kind} node did not become routable")

    def _generate(self, prompt: str, n: int) -> dict:
        from fabric import Client

        ids, times = [], []
        with Client(self.tracker, timeout=300.0) as client:
            for event in client.generate(self.model_id, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=n):
                if event.event == "token" and event.token_ids:
                    ids.extend(event.token_ids)
                    times.append(time.perf_counter())
        # a token event may carry several ids (held back by the detokenizer); time per event
        return {"ids": ids, "decode_s": (times[-1] - times[0]) if len(times) > 1 else 0.0,
                "decode_tokens": max(0, len(ids) - 1) if len(times) > 1 else 0}

    def run(self) -> dict:
        import psutil

        node = psutil.Process(self.procs[1].pid)
        cpu0 = sum(node.cpu_times()[:2])
        runs = [self._generate(p, self.tokens) for p in PROMPTS]
        return {"runs": runs, "cpu_s": sum(node.cpu_times()[:2]) - cpu0}

    @property
    def pids(self):
        return [p.pid for p in self.procs]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _wanted(args, notes: list[str]) -> list[str]:
    """The configurations to measure: ``--configs`` less llama.cpp when it is not installed, with
    ``executor-SCHEME`` for a ``node-SCHEME`` the CLI cannot start yet (each change noted)."""
    import importlib.util

    wanted = list(args.configs)
    if "llama.cpp" in wanted and importlib.util.find_spec("llama_cpp") is None:
        wanted.remove("llama.cpp")
        notes.append("llama.cpp: skipped, llama-cpp-python is not installed (pip install llama-cpp-python "
                     "compiles llama.cpp for many minutes); no measured llama.cpp baseline in this run")
    choices = cli_quant_choices()
    for scheme in SCHEMES:
        kind = f"node-{scheme}"
        if kind in wanted and scheme not in choices:
            wanted[wanted.index(kind)] = f"executor-{scheme}"
            notes.append(f"{kind}: `meshnet node` has no --quant {scheme} yet; measured executor-{scheme} instead "
                         f"(load_shard(quant='{scheme}') + ShardExecutor in a worker process, no sockets)")
    return wanted


def _start(procs: Procs, args, tmp: Path, wanted: list[str], notes: list[str]) -> list:
    """A loaded worker or node cluster per wanted configuration; one that fails to start is noted and left out."""
    targets: list = []
    for kind in wanted:
        log(f"loading {kind} ({args.threads} threads)")
        try:
            targets.append(NodeCluster(procs, args, tmp, kind.removeprefix("node-")) if kind.startswith("node-")
                           else Worker(procs, kind, args))
        except Exception as exc:  # noqa: BLE001 - report it and go on with the others
            notes.append(f"{kind}: failed to start: {exc}")
            log(f"{kind} failed: {exc}")
    return targets


def _timed_reps(args, targets: list) -> dict[str, list]:
    """Every target's timed runs, ``--reps`` rounds in rotating order: tok/s, the others' CPU share,
    CPU ms per token and the greedy ids."""
    results: dict[str, list] = {t.kind: [] for t in targets}
    for rep in range(args.reps):
        order = targets[rep % len(targets):] + targets[:rep % len(targets)]
        for t in order:
            before = wait_quiet(args.max_wait)
            with LoadMeter(t.pids) as meter:
                r = t.run()
            runs = r["runs"]
            tps = sum(x["decode_tokens"] for x in runs) / max(1e-9, sum(x["decode_s"] for x in runs))
            tokens = sum(len(x["ids"]) for x in runs)
            results[t.kind].append({"tps": tps, "foreign": meter.foreign, "foreign_before": before,
                                    "cpu_ms_per_token": 1e3 * r.get("cpu_s", 0.0) / max(1, tokens),
                                    "ids": [x["ids"] for x in runs]})
            log(f"rep {rep + 1}/{args.reps} {t.kind}: {tps:.1f} tok/s (others used {meter.foreign:.0%} of the CPU)")
    return results


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="quant-bench-"))
    procs = Procs(tmp)
    def on_term(signum, frame):
        log("SIGTERM: stopping every process this run started")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    notes: list[str] = []
    try:
        targets = _start(procs, args, tmp, _wanted(args, notes), notes)
        results = _timed_reps(args, targets)
        info = {t.kind: t.info for t in targets}
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return analyse(args, results, info, notes)


def _rows(results: dict, info: dict) -> dict:
    """Per configuration: median tok/s and CPU ms per token over the quiet reps (all reps, flagged
    noisy, when none was quiet), every rep's figures, load time and RSS."""
    rows = {}
    for kind, reps in results.items():
        quiet = [r for r in reps if r["foreign"] <= QUIET]
        use = quiet or reps
        rows[kind] = {"tps": median([r["tps"] for r in use]), "all_tps": [round(r["tps"], 2) for r in reps],
                      "cpu_ms_per_token": median([r["cpu_ms_per_token"] for r in use]),
                      "foreign": [round(r["foreign"], 3) for r in reps], "quiet_reps": len(quiet),
                      "noisy": not quiet,
                      "load_s": info.get(kind, {}).get("load_s"), "rss": info.get(kind, {}).get("rss")}
    return rows


def _scheme_figures(scheme: str, rows: dict, results: dict, ratios: dict, checks: dict, verdicts: dict,
                    notes: list[str]) -> None:
    """Adds the ratios, greedy checks and verdict of ``scheme``'s node (or executor) against its
    baselines to ``ratios``, ``checks`` and ``verdicts``, and where it diverges to ``notes``."""
    fab = next((k for k in (f"node-{scheme}", f"executor-{scheme}") if k in rows), None)
    if fab is None:
        return
    for base in ("hf-float32", "hf-bfloat16", f"hf-{scheme}", "llama.cpp"):
        if base in rows and rows[base]["tps"] and rows[fab]["tps"]:
            ratios[f"{fab} / {base}"] = rows[fab]["tps"] / rows[base]["tps"]
    ref = f"hf-{scheme}"
    if ref in results:
        want = results[ref][0]["ids"]
        checks[f"{fab} greedy ids == {ref} (every prompt, every rep)"] = all(r["ids"] == want for r in results[fab])
        checks[f"{ref} greedy ids identical across reps"] = all(r["ids"] == want for r in results[ref])
        got = next((r["ids"] for r in results[fab] if r["ids"] != want), None)
        for i, (a, b) in enumerate(zip(got or [], want)):
            if a != b:
                notes.append(f"{fab} diverges from {ref} on prompt {i}: {_prefix(a, b)} tokens agree")
    if "hf-float32" in results:
        want = results["hf-float32"][0]["ids"]
        checks[f"{fab} vs hf-float32: tokens before the first difference, per prompt"] = [
            _prefix(a, b) for a, b in zip(results[fab][0]["ids"], want)]
    key = f"{fab} / llama.cpp"
    if key in ratios:
        verdicts[key] = "PASS" if ratios[key] >= TARGET else "MISS"


def _floor_figures(rows: dict, ratios: dict, checks: dict) -> None:
    """Adds each int8 configuration's tok/s over the bare int8 kernels' to ``ratios`` and, with llama.cpp
    measured, the time per token left for everything else at the target to ``checks``."""
    if "floor-int8" not in rows:
        return
    for other in ("hf-int8", "node-int8", "executor-int8", "compiled-int8", "llama.cpp"):
        if other in rows and rows[other]["tps"] and rows["floor-int8"]["tps"]:
            ratios[f"{other} / floor-int8"] = rows[other]["tps"] / rows["floor-int8"]["tps"]
    if "llama.cpp" in rows and rows["llama.cpp"]["tps"] and rows["floor-int8"]["tps"]:
        # the time per token a node may spend outside the int8 products and still reach the target
        budget = 1e3 / (TARGET * rows["llama.cpp"]["tps"]) - 1e3 / rows["floor-int8"]["tps"]
        checks["ms per token left for everything but the int8 products at the 0.8x target"] = round(budget, 2)


def _reference_checks(results: dict, checks: dict) -> None:
    """Adds to ``checks`` whether compiled-int8 matches hf-int8, and how far bfloat16 agrees with float32."""
    if "compiled-int8" in results and "hf-int8" in results:
        want = results["hf-int8"][0]["ids"]
        checks["compiled-int8 greedy ids == hf-int8 (every prompt, every rep)"] = all(
            r["ids"] == want for r in results["compiled-int8"])
    if "hf-bfloat16" in results and "hf-float32" in results:
        checks["hf-bfloat16 vs hf-float32: tokens before the first difference, per prompt"] = [
            _prefix(a, b) for a, b in zip(results["hf-bfloat16"][0]["ids"], results["hf-float32"][0]["ids"])]


def analyse(args, results: dict, info: dict, notes: list[str]) -> dict:
    rows = _rows(results, info)
    ratios, checks, verdicts = {}, {}, {}
    for scheme in SCHEMES:
        _scheme_figures(scheme, rows, results, ratios, checks, verdicts, notes)
    _floor_figures(rows, ratios, checks)
    _reference_checks(results, checks)
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": args.model,
            "threads": args.threads, "tokens": args.tokens, "reps": args.reps, "prompts": list(PROMPTS),
            "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
                        "torch": _version("torch"), "transformers": _version("transformers")},
            "rows": rows, "ratios": ratios, "checks": checks, "verdicts": verdicts, "target": TARGET,
            "design_reference": {"llama.cpp_tps": DESIGN_LLAMA_CPP_TPS,
                                 "note": "DESIGN.md figure from an earlier session on the dev machine; "
                                         "a reference only, not measured in this run"},
            "notes": notes}


def _prefix(a: list, b: list) -> str:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{max(len(a), len(b))}"


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "?"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_report(r: dict) -> None:
    print(f"\nquant bench: {r['model']}, {r['threads']} threads, {r['tokens']} new tokens x {len(r['prompts'])} "
          f"prompts, {r['reps']} reps, {r['machine']['cpu']} ({r['machine']['cores']} cores), "
          f"torch {r['machine']['torch']}")
    print(f"{'config':<16}{'decode tok/s':>14}   {'all reps':<28}{'others CPU':<26}{'CPU ms/tok':>11}{'load s':>8}"
          f"{'RSS MiB':>9}")
    for kind, row in r["rows"].items():
        tps = f"{row['tps']:.1f}" if row["tps"] else "-"
        noisy = " (noisy)" if row["noisy"] else f" ({row['quiet_reps']} quiet)"
        rss = f"{row['rss'] / 2**20:.0f}" if row.get("rss") else "-"
        load = f"{row['load_s']:.1f}" if row.get("load_s") else "-"
        cpu = f"{row['cpu_ms_per_token']:.1f}" if row.get("cpu_ms_per_token") else "-"
        print(f"{kind:<16}{tps:>14}   {str(row['all_tps']):<28}{str(row['foreign']) + noisy:<26}{cpu:>11}{load:>8}"
              f"{rss:>9}")
    for name, value in r["ratios"].items():
        print(f"ratio {name}: {value:.2f}x")
    for name, value in r["checks"].items():
        print(f"check {name}: {value}")
    ref = r["design_reference"]
    for scheme in SCHEMES:
        fab = next((k for k in (f"node-{scheme}", f"executor-{scheme}") if k in r["rows"]), None)
        if not fab or not r["rows"][fab]["tps"]:
            continue
        print(f"reference only (not measured here): DESIGN.md llama.cpp ~{ref['llama.cpp_tps']:.0f} tok/s; "
              f"{fab} is {r['rows'][fab]['tps'] / ref['llama.cpp_tps']:.2f}x of that figure "
              f"(target {r['target']}x = {r['target'] * ref['llama.cpp_tps']:.0f} tok/s)")
        key = f"{fab} / llama.cpp"
        verdict = r["verdicts"].get(key, "no verdict (llama.cpp not measured in this run)")
        print(f"target {fab} >= {r['target']}x llama.cpp, same GGUF and threads: {verdict}")
    for note in r["notes"]:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (stops early at EOS)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(ALL_CONFIGS), choices=[*ALL_CONFIGS, *EXTRA_CONFIGS])
    ap.add_argument("--max-wait", type=float, default=20.0, help="seconds to wait for a quiet machine per run")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    result = run(args)
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
