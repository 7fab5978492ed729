"""Whether outputs of one audited step agree, and who lied when they do not. No sockets.

An audit compares what one hop (the suspect) said it computed with what replicas holding
the same layers compute from the same input. Each output is a ``Claim``. Two claims agree
when their tensors are bit-equal, if both came from the same exact-mode arithmetic (float32,
unquantized, the same ``kernels``: torch version, device, CPU capability, threads), else
when their relative distance is within the tolerance (bfloat16, quantized, or different
kernels). A tail's claim also holds the token it sent: a token that does not follow from its
own logits disagrees with everything.

``judge`` settles by majority: the suspect agrees with the first replica (pass); else a
second replica sides with one of them, and the other one lied; else nobody is convicted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from ..wire.liveness import AUDIT_TOLERANCE as DEFAULT_TOLERANCE  # relative L2 distance allowed, not bit-exact


@dataclass(frozen=True)
class Claim:
    """One node's output for the audited step."""

    node: str
    output: torch.Tensor  # hidden states (1, q, hidden), or the tail's logits (vocab,)
    kernels: str = ""  # the exact-mode arithmetic it computed with; "": bfloat16 or quantized
    consistent: bool = True  # False: the tail's token does not follow from these logits


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; infinite when the shapes differ or a value is not finite."""
    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.double(), b.double()
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return math.inf
    return float(torch.linalg.vector_norm(a64 - b64) / max(float(torch.linalg.vector_norm(b64)), 1e-30))


def bit_exact(a: Claim, b: Claim) -> bool:
    """Whether ``a`` and ``b`` must be bit-equal: the same float32 exact-mode arithmetic."""
    return bool(a.kernels) and a.kernels == b.kernels and a.output.dtype == b.output.dtype == torch.float32


def agree(a: Claim, b: Claim, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    if not (a.consistent and b.consistent) or a.output.shape != b.output.shape:
        return False
    if bit_exact(a, b):
        return torch.equal(a.output, b.output)
    return distance(a.output, b.output) <= tolerance


def describe(a: Claim, b: Claim) -> str:
    """How far apart two claims are, in words (for logs and the tracker's event)."""
    if not a.consistent:
        return f"{a.node}'s token does not follow from its own logits"
    if a.output.shape != b.output.shape:
        return f"{a.node} gave shape {tuple(a.output.shape)}, {b.node} {tuple(b.output.shape)}"
    how = "bit-exact" if bit_exact(a, b) else "relative"
    return f"{a.node} vs {b.node}: relative distance {distance(a.output, b.output):.3g} ({how} comparison)"


class Outcome(StrEnum):
    PASS = "pass"  # the suspect agrees with a replica
    ASK = "ask"  # the suspect and a replica disagree: another replica settles it
    LIAR = "liar"  # two claims agree against a third: its node lied
    UNSETTLED = "unsettled"  # a disagreement that no majority settles


@dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    liar: str = ""  # LIAR: the node whose claim the other two contradict
    witnesses: tuple[str, ...] = ()  # LIAR: the two that agree; UNSETTLED: the replicas that disagreed
    detail: str = ""


def judge(suspect: Claim, replicas: list[Claim], more: bool, tolerance: float = DEFAULT_TOLERANCE) -> Judgement:
    """The verdict on ``suspect`` from the replicas' claims so far (in the order they were asked);
    ``more``: another replica could still be asked."""
    if not replicas:
        return Judgement(Outcome.ASK)
    first = replicas[0]
    if agree(suspect, first, tolerance):
        return Judgement(Outcome.PASS)
    detail = describe(suspect, first)
    if len(replicas) == 1:
        return Judgement(Outcome.ASK if more else Outcome.UNSETTLED, witnesses=(first.node,), detail=detail)
    second = replicas[1]
    if agree(first, second, tolerance) and not agree(suspect, second, tolerance):
        return Judgement(Outcome.LIAR, suspect.node, (first.node, second.node), detail)
    if agree(suspect, second, tolerance) and not agree(first, second, tolerance):
        return Judgement(Outcome.LIAR, first.node, (suspect.node, second.node), describe(first, second))
    return Judgement(Outcome.UNSETTLED, witnesses=(first.node, second.node), detail=detail)
