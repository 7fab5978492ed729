"""Honest clients stream while a rogue process attacks: did any attack get through, and did
any honest stream change?

The swarm is a tracker and three nodes (layers 0-1, 2-3, 4-5 of a tiny random model) in
threads of this process, on real loopback sockets, so the arena can read what an insider
would know (a live session's id, a kept one's) and hand it to the rogue. The rogue is a
process of its own (tests/adversary/rogue.py) with its own sockets, driven over stdin.

Each attack runs while honest greedy streams are in flight; their tokens and endings must be
those of the same streams run before any attack. An attack succeeded when the rogue saw that
it got through (``won``), or an honest stream changed (``harmed``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster import ThreadCluster
from tests.tiny_models import make_model

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["the quick brown fox jumps over the lazy dog and then", "meshnet splits a model across nodes so that",
           "hello world, how are you today? I am"]
MAX_SESSIONS = 16  # each node's limit: session_flood must meet it
INSIDER = {"cancel_leaked_hops", "close_leaked_hops", "forward_pos0_leaked", "forward_step_leaked",
           "cancel_leaked_batched", "forward_step_leaked_batched"}
LAST = ("session_flood",)  # holds the tail's session slots until their idle timeout: run after the others
AFTER = ("cross_tenant_prefix",)  # runs once the honest streams ended: its target is the KV they leave kept


@dataclass
class Outcome:
    attack: str
    won: bool  # the rogue got what it should not have
    harmed: int  # honest streams whose tokens or ending changed
    detail: str = ""

    @property
    def succeeded(self) -> bool:
        return self.won or self.harmed > 0


class Arena:
    def __init__(self, tmp: Path, tokens: int = 160):
        self.model = make_model("llama", tmp / "llama")
        self.tokens = tokens
        self.cluster = ThreadCluster()
        for name, (start, end) in {"h": (0, 1), "m": (2, 3), "t": (4, 5)}.items():
            self.cluster.add_node(self.model, start, end, 6, name, max_sessions=MAX_SESSIONS,
                                  kv_idle_timeout=5.0)
        self.cluster.wait_routable(self.model.name, 3)
        self.reference = self._streams()  # the honest streams with no attacker about
        self.rogue = subprocess.Popen(
            [sys.executable, "-m", "tests.adversary.rogue", "--tracker", self.cluster.endpoint,
             "--pub", self.cluster.tracker.pub_endpoint], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        json.loads(self.rogue.stdout.readline())  # ready

    def close(self) -> None:
        self.rogue.kill()
        self.rogue.wait(10)
        self.cluster.close()

    # -- honest clients -------------------------------------------------------------------

    def _streams(self, started: threading.Event | None = None) -> list[tuple]:
        """Greedy streams of every prompt at once: (token ids, finish reason) by prompt."""
        results: list = [None] * len(PROMPTS)

        def stream(i: int) -> None:
            with self.cluster.client() as client:
                ids, finish = [], None
                for event in client.generate(self.model.name, messages=[{"role": "user", "content": PROMPTS[i]}],
                                             max_tokens=self.tokens, ignore_eos=True):
                    ids.extend(event.token_ids)
                    finish = event.finish_reason or finish
                    if len(ids) >= 8 and started is not None:
                        started.set()
                results[i] = (ids, finish)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return results

    # -- attacks ----------------------------------------------------------------------------

    def attack(self, name: str) -> Outcome:
        """Run ``name`` while the honest streams are in flight (after them, for an attack on
        what they leave behind)."""
        started, result = threading.Event(), {}
        honest = threading.Thread(target=lambda: result.setdefault("streams", self._streams(started)))
        kept_before = self._kept()
        honest.start()
        started.wait(60)
        if name in AFTER:
            honest.join(120)
        hits = self._hits()
        answer = self._command({"attack": name, **self._knowledge(name, kept_before)})
        honest.join(120)
        harmed = sum(got != want for got, want in zip(result.get("streams") or [None] * 3, self.reference))
        won = bool(answer.get("won")) or (name in AFTER and self._hits() > hits)
        return Outcome(name, won, harmed, json.dumps(answer, default=str)[:400])

    def _knowledge(self, name: str, kept: list[str]) -> dict:
        """What the rogue is told: the model's shape, and an insider's secrets."""
        config = {"hidden": 64, "vocab": 320, "context": 8192, "limit": MAX_SESSIONS,
                  "messages": [{"role": "user", "content": PROMPTS[0]}]}
        if name in INSIDER:
            tail = self.cluster.nodes["t"]
            deadline = time.monotonic() + 10
            while not tail.kv.sessions() and time.monotonic() < deadline:
                time.sleep(0.01)
            config["leaked"] = leaked = next(iter(tail.kv.sessions()), "")
            kv = tail.kv.get(leaked)
            config["pos"] = kv.length if kv is not None else 8  # where the session is now
        if name == "reuse_kept":
            config["kept"] = kept[0] if kept else ""
        return config

    def _kept(self) -> list[str]:
        return list(self.cluster.nodes["t"].kv.retained.sessions())

    def _hits(self) -> int:
        return sum(n.kv.retained.stats["hits"] for n in self.cluster.nodes.values())

    def _command(self, cmd: dict) -> dict:
        self.rogue.stdin.write(json.dumps(cmd) + "\n")
        self.rogue.stdin.flush()
        return json.loads(self.rogue.stdout.readline())

    def run_all(self, names: list[str]) -> list[Outcome]:
        ordered = [n for n in names if n not in LAST] + [n for n in names if n in LAST]
        return [self.attack(name) for name in ordered]
