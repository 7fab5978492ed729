#!/usr/bin/env python
"""Every attack a rogue knows, under load: how many got through, how many honest streams changed.

    python bench/adversary.py [--rounds 1] [--tokens 160] [--attack NAME ...]

Starts a tracker and three nodes (layers 0-1, 2-3, 4-5 of a tiny random llama) on loopback,
and a rogue process of its own (tests/adversary/rogue.py). For each attack of
tests/adversary/attacks.py, three honest clients stream greedy answers of ``--tokens`` tokens
at once while the rogue attacks; an attack that targets what ended requests leave behind
runs as they end. An attack succeeded when the rogue saw it get through, or when any honest
stream's tokens or ending differ from the same streams run before the rogue started.

Prints one line per attack and the totals: attacks tried, attacks that succeeded (goal 0),
honest streams harmed (goal 0). Exits 1 when any attack succeeded or any stream was harmed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.adversary.arena import Arena  # noqa: E402
from tests.adversary.attacks import ATTACKS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="times each attack runs")
    parser.add_argument("--tokens", type=int, default=160, help="tokens each honest stream generates")
    parser.add_argument("--attack", action="append", choices=sorted(ATTACKS), help="only these (repeatable)")
    args = parser.parse_args()
    names = args.attack or list(ATTACKS)
    with tempfile.TemporaryDirectory() as tmp:
        arena = Arena(Path(tmp), tokens=args.tokens)
        try:
            outcomes = [o for _ in range(args.rounds) for o in arena.run_all(names)]
        finally:
            arena.close()
    for o in outcomes:
        verdict = "SUCCEEDED" if o.succeeded else "failed"
        print(f"{o.attack:28s} {verdict:9s} honest streams harmed: {o.harmed}")
    won = sum(o.succeeded for o in outcomes)
    harmed = sum(o.harmed for o in outcomes)
    print(f"attack kinds: {len(set(names))}; attacks tried: {len(outcomes)}; succeeded: {won} (goal 0); "
          f"honest streams harmed: {harmed} of {len(outcomes) * 3} (goal 0)")
    return 1 if won or harmed else 0


if __name__ == "__main__":
    sys.exit(main())
