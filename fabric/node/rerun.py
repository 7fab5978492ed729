"""What a head keeps of a session it audits, and the replay of it, stage by stage. No sockets.

``Claims``: the token id at each position (the prompt, then each FORWARD the head sent), and
for each hop of the route past the head, the sketch rows its AUDIT_TAPs gave per position
(fabric/node/taps.py). Only taps that echo the session's tap id reach it; the first tap of a
step and position counts, and a hop's taps must all come with the key of its first. A new
route (a failover re-prefills from position 0 on it) starts the claims afresh.

``Rerun``: the replay of a finished session's stretch. Stage 0 re-runs the head's own layers
on the token ids (the head trusts itself); each later stage sends the previous stage's
output to replicas of the next hop's layers and judges that hop (fabric/node/verdicts.py):
its sketched outputs at every position it computed, and on the tail the logits and tokens
of a window of at most MAX_AUDIT_LOGITS positions that produced tokens.
"""
from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field

import torch

from ..wire import protocol as p
from .verdicts import Claim, Judgement, sketch

MAX_ROWS = 16384  # positions x hops a kept session holds at most; taps past it are not kept


@dataclass
class Row:
    inp: torch.Tensor  # (SKETCH_DIM,): the hop's input at this position
    out: torch.Tensor | None = None  # (SKETCH_DIM,): its output (the tail: the logits computed here)
    token: int = -1  # the tail: the token it sampled from those logits


def _span(hop: p.Hop) -> tuple[str, int, int]:
    return hop.node, hop.start_layer, hop.end_layer


@dataclass
class Claims:
    session: str
    ids: list[int]  # the token id at each position
    sampling: p.Sampling = p.Sampling()
    penalized: bool = False  # penalties, logit_bias or a grammar moved the logits the tail sampled from: not their argmax
    route: tuple[p.Hop, ...] = ()  # the route the rows were computed on, the head's own hop first
    rows: dict[int, dict[int, Row]] = field(default_factory=dict)  # a hop's start_layer -> position -> row
    keys: dict[int, str] = field(default_factory=dict)  # a hop's start_layer -> the key its taps came with
    seen: set[tuple[int, int, int]] = field(default_factory=set)  # (step, start_layer, pos) of the taps taken
    size: int = 0

    def sent(self, route: tuple[p.Hop, ...], msg: p.Forward, ids: torch.Tensor) -> None:
        """The head sent ``msg`` (token ids (1, q) at msg.pos) along ``route``."""
        if tuple(map(_span, route)) != tuple(map(_span, self.route)):
            self.route = route
            self.rows, self.keys, self.seen, self.size = {}, {}, set(), 0
        self.sampling = msg.sampling
        if msg.pos == 0 or msg.reuse:
            self.penalized = msg.penalties is not None or msg.grammar is not None
        if msg.pos <= len(self.ids):
            self.ids[msg.pos:msg.pos + ids.shape[1]] = [int(t) for t in ids[0]]

    def take(self, msg: p.AuditTap, tensors: list[torch.Tensor], sender: str) -> bool:
        """Keep a tap of a hop of the route; False for one that is not (stale, second, or another key's)."""
        hop = next((h for h in self.route[1:] if (h.start_layer, h.end_layer) == (msg.start_layer, msg.end_layer)),
                   None)
        q = tensors[0].shape[0]
        if hop is None or (msg.step, msg.start_layer, msg.pos) in self.seen or self.size + q > MAX_ROWS:
            return False
        if self.keys.setdefault(msg.start_layer, sender) != sender:
            return False
        self.seen.add((msg.step, msg.start_layer, msg.pos))
        self.size += q
        rows = self.rows.setdefault(msg.start_layer, {})
        for i in range(q):
            rows[msg.pos + i] = Row(tensors[0][i])
        if len(tensors) == 2 and msg.token >= 0:  # the tail: the logits of the last position
            rows[msg.pos + q - 1].out, rows[msg.pos + q - 1].token = tensors[1][0], msg.token
        elif len(tensors) == 2:
            for i in range(q):
                rows[msg.pos + i].out = tensors[1][i]
        return True

    def stretch(self, rng: random.Random) -> tuple[int, int]:
        """(positions to replay, the first whose logits the tail's replicas return): a random
        window of at most MAX_AUDIT_LOGITS positions where the tail sampled a token."""
        tail = self.rows.get(self.route[-1].start_layer, {}) if len(self.route) > 1 else {}
        sampled = sorted(pos for pos, row in tail.items() if row.out is not None and pos < len(self.ids))
        if not sampled:
            return 0, -1
        first = rng.randrange(max(1, len(sampled) - p.MAX_AUDIT_LOGITS + 1))
        window = sampled[first:first + p.MAX_AUDIT_LOGITS]
        while window[-1] - window[0] >= p.MAX_AUDIT_LOGITS:  # a gap (a re-prefill): keep it contiguous
            window.pop()
        return window[-1] + 1, window[0]

    def claim(self, hop: p.Hop, n: int, window: int) -> Claim:
        """What ``hop`` said it computed at the positions a replay of ``n`` compares."""
        rows = self.rows.get(hop.start_layer, {})
        low = window if hop is self.route[-1] else 0
        positions = tuple(pos for pos in sorted(rows) if low <= pos < n and rows[pos].out is not None)
        stacked = torch.stack([rows[pos].out for pos in positions]) if positions else torch.zeros(0, p.SKETCH_DIM)
        return Claim(hop.node, stacked, positions, tokens=tuple(rows[pos].token for pos in positions))

    def inputs(self, hop: p.Hop, n: int) -> tuple[tuple[int, ...], torch.Tensor]:
        """(positions, their input rows) ``hop`` said it received, below ``n``."""
        rows = self.rows.get(hop.start_layer, {})
        positions = tuple(pos for pos in sorted(rows) if pos < n)
        return positions, torch.stack([rows[pos].inp for pos in positions]) if positions else torch.zeros(0)


def replica_claim(node: str, output: torch.Tensor, positions: tuple[int, ...], window: int) -> Claim:
    """A replica's output as a Claim at ``positions``: hidden states (1, n, hidden), or a tail's
    logits (rows, vocab) of positions window.."""
    if output.dim() == 3:
        picked = output[0, list(positions)] if positions else output[0, :0]  # (len, hidden)
        return Claim(node, sketch(picked) if positions else torch.zeros(0, p.SKETCH_DIM), positions)
    index = [pos - window for pos in positions]
    if any(not 0 <= i < output.shape[0] for i in index):
        return Claim(node, torch.full((len(positions), p.SKETCH_DIM), float("nan")), positions)
    logits = output[index].float()  # (len, vocab)
    return Claim(node, sketch(logits) if positions else torch.zeros(0, p.SKETCH_DIM), positions, logits=logits)


@dataclass
class Rerun:
    """The replay of one session's stretch through replicas, stage by stage."""

    claims: Claims
    n: int  # positions replayed: 0..n-1
    window: int  # the first position whose logits the tail's replicas return
    moved: float  # when it last moved on; it gives up a timeout after
    tap: str = ""  # the session's tap id (its claims are kept under it until the replay ends)
    stage: int = 0  # the route's hop being re-run: 0 the head's own
    input: torch.Tensor | None = None  # the current stage's input: token ids (1, n), else hidden states
    request: str = ""  # the id of the open REPLICAS_REQUEST
    suspect_key: str = ""  # the key the tracker lists for the stage's hop
    untried: list[p.Hop] | None = None  # replicas not asked yet; None: the tracker has not answered
    asked: dict[str, p.Hop] = field(default_factory=dict)  # open AUDIT ids -> the node asked
    answers: list[Claim] = field(default_factory=list)  # the replicas' claims, in the order asked
    outputs: list[torch.Tensor] = field(default_factory=list)  # ...and their outputs
    mismatch: Judgement | None = None  # a disagreement seen so far, reported if nothing settles it

    @property
    def hop(self) -> p.Hop:
        """The hop this stage judges: at stage 0 (this node's own layers, trusted) the first past it."""
        return self.claims.route[max(self.stage, 1)]

    @property
    def tail(self) -> bool:
        return self.stage == len(self.claims.route) - 1

    def next_stage(self, output: torch.Tensor, untried: list[p.Hop] | None = None) -> None:
        """On to the next hop, ``output`` its input; ``untried``: its replicas, where known already."""
        self.stage += 1
        self.input, self.request, self.suspect_key, self.untried = output, "", "", untried
        self.asked, self.answers, self.outputs, self.mismatch = {}, [], [], None

    def new_id(self) -> str:
        return secrets.token_hex(16)
