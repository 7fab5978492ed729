"""A node that lies, for tests and benchmarks only: ``meshnet`` with every hop's output wrong.

    python tests/liar_node.py [meshnet flags] node --model ... --layers ...

It patches the shard executor before the command starts, so that each result is taken from
hidden states reversed along the hidden dimension: it speaks the protocol, registers the
honest fingerprint, and returns plausible-looking but wrong hidden states and logits, as a
node with other weights, bad hardware or a bug would. No production flag does this.
"""
from __future__ import annotations

import sys

from fabric.compute.executor import ShardExecutor

_honest_result = ShardExecutor._result


def _lying_result(self, hidden, end):
    return _honest_result(self, hidden.flip(-1), end)  # (b, q, hidden), reversed: wrong, same shape and scale


ShardExecutor._result = _lying_result

if __name__ == "__main__":
    from fabric.cli import main

    sys.exit(main())
