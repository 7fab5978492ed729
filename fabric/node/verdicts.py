"""Whether outputs of one audited stretch agree, and who lied when they do not. No sockets.

Every hop sends its head a *sketch* of each step it runs (AUDIT_TAP): per position, SKETCH_DIM
numbers that a count sketch draws from the hidden states (or the tail's logits), a random but
fixed linear map that every node computes alike. The relative distance of two sketches
estimates the relative distance of what they sketch (within about a quarter at SKETCH_DIM 32),
so a head that keeps a few hundred bytes per position can later compare what a hop said it
computed with what replicas compute from the same input.

A hop's ``Claim`` is its rows of sketches at the positions it computed, and on the tail the
tokens it sampled; a replica's is its sketched output at those positions, and on a tail's span
its logits. Rows agree when their relative distance is within the tolerance: a replay runs a
whole stretch in one pass where the hop ran it token by token, so even float32 results differ
in their last bits, and bit-equality is never asked for. A tail's token disagrees with a
replica's logits when it is not the one they give and it trails their choice by more than
TOKEN_GAP of their spread (greedy requests only: a seeded draw near a boundary of the
distribution could honestly go either way).

``judge`` settles by majority: the suspect agrees with the first replica (pass); else a
second replica sides with one of them; two replicas that agree with each other and not with
the suspect by more than CONVICT_FACTOR tolerances at a position (or on a token) convict
it; a second replica that sides with the suspect passes it (the first replica's mismatch is
reported); anything else convicts nobody. The margin is measured: SmolLM2's default mode
once put an honest tail 0.105 from its replay at one position of eight, over a tolerance
of 0.1 (a liar's rows are 1 to 2 away); reported, never convicted.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from ..compute.lean_ops import count_sketch
from ..wire.liveness import AUDIT_TOLERANCE as DEFAULT_TOLERANCE  # relative L2 distance allowed
from ..wire.protocol import SKETCH_DIM

SKETCH_SEED = 0x5EED  # the count sketch's buckets and signs: the same on every node, for every width
TOKEN_GAP = 1.0  # a tail's token is wrong when it trails the replicas' choice by this many standard deviations
CONVICT_FACTOR = 3.0  # a conviction needs a row this many tolerances away: between 1 and 3, a mismatch is reported


@functools.lru_cache(maxsize=8)
def _buckets(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket and sign of each of ``width`` coordinates."""
    gen = torch.Generator().manual_seed(SKETCH_SEED + width)
    bucket = torch.randint(0, SKETCH_DIM, (width,), generator=gen)
    sign = torch.randint(0, 2, (width,), generator=gen).float() * 2 - 1
    return bucket, sign


def sketch(x: torch.Tensor) -> torch.Tensor:
    """A count sketch of each row of ``x`` (..., width) -> (rows, SKETCH_DIM) float32: each
    coordinate, its sign flipped at random, added into one of SKETCH_DIM buckets, in float32
    (a bucket sums width / SKETCH_DIM numbers: rounding stays near 1e-6 of it, far under any
    tolerance). O(width) per row; ||sketch(a) - sketch(b)|| estimates ||a - b|| without bias."""
    rows = x.detach().reshape(-1, x.shape[-1])  # (rows, width)
    bucket, sign = _buckets(rows.shape[1])
    out = count_sketch(rows, bucket, sign, SKETCH_DIM)  # one C call, the same bits: a tap's cost halved
    if out is not None:
        return out
    rows = rows.float().cpu()
    out = torch.zeros(rows.shape[0], SKETCH_DIM, dtype=torch.float32)
    return out.index_add_(1, bucket, rows * sign)  # (rows, SKETCH_DIM)


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; infinite when the shapes differ or a value is not finite."""
    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.double(), b.double()
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return math.inf
    return float(torch.linalg.vector_norm(a64 - b64) / max(float(torch.linalg.vector_norm(b64)), 1e-30))


def row_distances(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """``distance`` of each row of ``a`` (n, k) from the same row of ``b``."""
    if a.shape != b.shape:
        return [math.inf] * max(len(a), 1)
    return [distance(x, y) for x, y in zip(a, b)]


@dataclass(frozen=True)
class Claim:
    """One node's output over the audited positions."""

    node: str
    rows: torch.Tensor  # (n, SKETCH_DIM): sketches of its output at the positions compared
    positions: tuple[int, ...]  # the position of each row
    tokens: tuple[int, ...] = ()  # a suspect tail: the token it sent at each row's position (-1: none)
    logits: torch.Tensor | None = None  # a replica of a tail's span: its logits (n, vocab) at those positions


def _token_gap(logits: torch.Tensor, token: int) -> float:
    """How far ``token`` trails the greedy choice of ``logits`` (vocab,), in standard deviations."""
    if not 0 <= token < logits.shape[-1]:
        return math.inf
    top = int(torch.argmax(logits))
    return float(logits[top] - logits[token]) / max(float(logits.float().std()), 1e-30) if top != token else 0.0


def disagreement(a: Claim, b: Claim, tolerance: float = DEFAULT_TOLERANCE, greedy: bool = True) -> str:
    """Why ``a`` does not agree with ``b`` (""; they agree): a row further than ``tolerance``
    from b's, or a token of ``a`` that b's logits clearly refuse."""
    if a.positions != b.positions:
        return f"{a.node} and {b.node} cover other positions"
    far = [(d, p) for d, p in zip(row_distances(a.rows, b.rows), a.positions) if not d <= tolerance]
    if far:
        worst, at = max(far)
        return (f"{a.node} vs {b.node}: {len(far)} of {len(a.positions)} positions apart, relative distance "
                f"up to {worst:.3g} (position {at})")
    if greedy and a.tokens and b.logits is not None:
        for token, row, pos in zip(a.tokens, b.logits, a.positions):
            if token >= 0 and _token_gap(row, token) > TOKEN_GAP:
                return f"{a.node}'s token {token} at position {pos} is not the one {b.node}'s logits give"
    return ""


class Outcome(StrEnum):
    PASS = "pass"  # the suspect agrees with a replica
    ASK = "ask"  # the suspect and a replica disagree: another replica settles it
    LIAR = "liar"  # two replicas agree with each other against the suspect
    ODD_REPLICA = "odd_replica"  # the second replica sides with the suspect against the first: it passes
    UNSETTLED = "unsettled"  # a disagreement that no pair of replicas settles


@dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    liar: str = ""  # LIAR: the suspect; ODD_REPLICA: the first replica
    # LIAR: the two replicas that agree; UNSETTLED: the replicas that disagreed; ODD_REPLICA: the second replica
    witnesses: tuple[str, ...] = ()
    detail: str = ""


def judge(suspect: Claim, replicas: list[Claim], more: bool, tolerance: float = DEFAULT_TOLERANCE,
          greedy: bool = True) -> Judgement:
    """The verdict on ``suspect`` from the replicas' claims so far (in the order asked); ``more``:
    another replica could still be asked. Only two replicas can convict: a suspect siding with
    the second against the first convicts nobody (the head only asked them; it cannot tell)."""
    if not replicas:
        return Judgement(Outcome.ASK)
    first = replicas[0]
    detail = disagreement(suspect, first, tolerance, greedy)
    if not detail:
        return Judgement(Outcome.PASS)
    if len(replicas) == 1:
        return Judgement(Outcome.ASK if more else Outcome.UNSETTLED, witnesses=(first.node,), detail=detail)
    second = replicas[1]
    against = disagreement(suspect, second, tolerance, greedy)
    odd = disagreement(second, first, tolerance, greedy=False)
    far = all(disagreement(suspect, r, CONVICT_FACTOR * tolerance, greedy) for r in (first, second))
    if against and not odd and far:
        return Judgement(Outcome.LIAR, suspect.node, (first.node, second.node), detail)
    if not against and odd:  # one replica's word against two outputs: nobody is convicted, the hop passes
        return Judgement(Outcome.ODD_REPLICA, first.node, (second.node,), odd)
    return Judgement(Outcome.UNSETTLED, witnesses=(first.node, second.node), detail=detail)
