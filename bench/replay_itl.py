#!/usr/bin/env python
"""What an audit's replay costs the streams of the node that runs it.

    python bench/replay_itl.py [--model smollm2-135m] [--positions 1500] [--rounds 3] [--tokens 96]
                               [--other DIR]

Starts `meshnet up`'s 2-node split (``bench/ab_waves.py``'s clusters: the default flags), then,
``--rounds`` times, streams one greedy request of ``--tokens`` tokens and, a quarter of the way
in, sends the head an AUDIT of ``--positions`` token ids over its own layers, as another head
auditing a request of that length would (an audit's replay re-runs the whole stretch from
position 0). Printed per round: the stream's median gap between tokens outside the replay, its
longest gap while the replay ran, and how long the replay took to answer. A replay that runs
as one pass holds the stream for all of it; one in slices lets decode steps through between
them. ``--other DIR`` runs another checkout's nodes the same way, alternated round by round.
"""
from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import zmq  # noqa: E402

import ab_waves  # noqa: E402
import fabric_bench as fb  # noqa: E402
from fabric.client import Client  # noqa: E402
from fabric.compute.models import default_cache_root, load_config, resolve  # noqa: E402
from fabric.compute.tensors import to_wire  # noqa: E402
from fabric.wire import protocol as p  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper."


def audit_frames(positions: int, end_layer: int, reply_to: str) -> list:
    ids = torch.randint(100, 20000, (1, positions), generator=torch.Generator().manual_seed(positions))
    spec, buf = to_wire(ids)
    msg = p.Audit(secrets.token_hex(16), 0, end_layer, reply_to, tensors=(spec,))
    return p.encode(msg, [buf])


def one_round(c: fb.Cluster, model: str, positions: int, tokens: int) -> tuple[float, float, float]:
    """(median gap outside the replay, longest gap during it, the replay's time to answer), seconds."""
    ctx = zmq.Context.instance()
    answers = ctx.socket(zmq.ROUTER)
    port = answers.bind_to_random_port("tcp://127.0.0.1")
    with Client(c.tracker, timeout=120) as client:
        head = client.route(model)[0]
        sender = ctx.socket(zmq.DEALER)
        sender.connect(head.endpoint)
        arrivals: list[float] = []
        sent = answered = 0.0
        streamed = threading.Event()

        def fire() -> None:
            nonlocal sent, answered
            while len(arrivals) < tokens // 4:
                if streamed.is_set():
                    return  # the stream ended first (an error): nothing to measure
                time.sleep(0.005)
            sent = time.perf_counter()
            sender.send_multipart(audit_frames(positions, head.end_layer, f"tcp://127.0.0.1:{port}"))
            if answers.poll(300_000):
                answers.recv_multipart()
                answered = time.perf_counter()

        side = threading.Thread(target=fire)
        side.start()
        for event in client.generate(model, messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens,
                                     ignore_eos=True):
            if event.token_ids:
                arrivals.append(time.perf_counter())
        streamed.set()
        side.join()
        sender.close(0)
    answers.close(0)
    gaps = [(b - a, a, b) for a, b in zip(arrivals, arrivals[1:])]
    during = [g for g, a, b in gaps if b > sent and a < answered]
    outside = [g for g, a, b in gaps if b <= sent or a >= answered]
    return statistics.median(outside), max(during, default=0.0), answered - sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--positions", type=int, default=1500, help="the audited stretch's length (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96, help="the stream's tokens a round (default %(default)s)")
    ap.add_argument("--other", metavar="DIR", help="another checkout, alternated round by round")
    args = ap.parse_args()
    source = resolve(args.model)
    layers = load_config(source, default_cache_root()).num_hidden_layers
    specs = ([f"other@{args.other}"] if args.other else []) + ["this"]
    tmp = Path(tempfile.mkdtemp(prefix="replay-itl-"))
    procs = fb.Procs(tmp)
    try:
        clusters = [ab_waves.start(procs, spec, args.model, layers, tmp, False) for spec in specs]
        fb.wait_ready(procs, clusters, source.model_id)
        rows: dict[str, list] = {c.key: [] for c in clusters}
        for r in range(args.rounds):
            for c in clusters if r % 2 == 0 else clusters[::-1]:
                median, longest, took = one_round(c, source.model_id, args.positions, args.tokens)
                rows[c.key].append((median, longest, took))
                print(f"round {r + 1} {c.key}: gap median {median * 1e3:.1f} ms, longest during the replay "
                      f"{longest * 1e3:.1f} ms ({longest / median:.1f}x), replay answered in {took:.2f} s", flush=True)
        for key, got in rows.items():
            med = statistics.median(g[0] for g in got)
            worst = statistics.median(g[1] for g in got)
            took = statistics.median(g[2] for g in got)
            print(f"{key}: median gap {med * 1e3:.1f} ms; longest gap during a {args.positions}-position replay "
                  f"{worst * 1e3:.1f} ms ({worst / med:.1f}x the median); replay {took:.2f} s (medians of rounds)")
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
