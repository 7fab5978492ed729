"""A node that lies, for tests and benchmarks only: ``meshnet`` with wrong hop outputs.

    python tests/liar_node.py [--lie all|decode] [meshnet flags] node --model ... --layers ...

It patches the shard executor before the command starts, so that a result is taken from
hidden states reversed along the hidden dimension: it speaks the protocol, registers the
honest fingerprint, and returns plausible-looking but wrong hidden states and logits, as a
node with other weights, bad hardware or a bug would. ``--lie all`` (the default) lies on
every step; ``--lie decode`` only on decode steps (one position per row: its prefills are
honest), as a node would that counts on audits checking prompts only. No production flag
does this.
"""
from __future__ import annotations

import sys

from fabric.compute.executor import ShardExecutor

MODES = ("all", "decode")
_honest_result, _honest_outputs = ShardExecutor._result, ShardExecutor._outputs


def _lying_result(self, hidden, end):
    return _honest_result(self, hidden.flip(-1), end)  # (b, q, hidden), reversed: wrong, same shape and scale


def _decode_lying_result(self, hidden, end):
    if hidden.shape[1] != 1 or getattr(self, "_liar_honest", False):  # a prompt's positions: honest
        return _honest_result(self, hidden, end)
    return _lying_result(self, hidden, end)  # decode steps: (b, 1, hidden), each row one session's step


def _decode_lying_outputs(self, hidden, end, rows, chunks):
    """A pass's decode steps lie, and so do verifications and one-position chunks; a prompt's
    chunk of several positions does not (each chunk from an lm_head call of its own here)."""
    out = _honest_outputs(self, hidden, end, rows, []) if rows else []
    for chunk in chunks:
        self._liar_honest = chunk[1].step.drafts == 0 and chunk[1].step.inputs.shape[1] > 1
        try:
            out += _honest_outputs(self, hidden, end, [], [chunk])
        finally:
            self._liar_honest = False
    return out


def lie(mode: str = "all") -> None:
    """Make every ShardExecutor of this process lie (``mode``: "all" steps or "decode" steps only)."""
    if mode not in MODES:
        raise SystemExit(f"--lie takes one of {', '.join(MODES)}, not {mode!r}")
    ShardExecutor._result = _lying_result if mode == "all" else _decode_lying_result
    ShardExecutor._outputs = _honest_outputs if mode == "all" else _decode_lying_outputs


def honest() -> None:
    """Put the honest executor back (a test that lied in its own process)."""
    ShardExecutor._result, ShardExecutor._outputs = _honest_result, _honest_outputs


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = "all"
    if args[:1] == ["--lie"] and len(args) > 1:
        mode, args = args[1], args[2:]
    lie(mode)
    sys.argv[1:] = args
    from fabric.cli import main

    sys.exit(main())
else:
    lie()  # imported (bench/audit.py's noise measure): every step lies, as before
