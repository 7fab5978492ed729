"""The hop's side of audits: sketch every step for the head, re-run a stretch for another head.

A head that audits sets ``audit`` (a secret tap id of the session) on every FORWARD of every
request it heads, audited or not. Every hop past the head answers each step it runs, as
usual and in whatever batch the scheduler put it, with an AUDIT_TAP to ``reply_to``: the tap
id, the step's positions, count sketches (fabric/node/verdicts.py) of its input and output
rows, and on the tail the token it sampled. So every step looks the same to a hop; the head
alone knows which sessions it will replay.

A replay is an AUDIT: run layers start..end on the given input from position 0 in a session
of its own, free it, answer AUDIT_RESULT with the output of every position (a tail's span:
the logits of the positions asked). Replays queue in the node's scheduler like hops
(``Replay``), and run between them under the compute lock.
No sockets here: the node sends what these return.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

from ..compute.compute_lock import ComputeLock
from ..compute.executor import ShardExecutor, StepResult
from ..compute.sampling import sample
from ..wire import protocol as p
from .hops import on_threads
from .scheduler import Replay, Work
from .verdicts import sketch

log = logging.getLogger(__name__)


def kernels(device: str, dtype: torch.dtype, quant: str | None) -> str:
    """What decides the bits of this node's output in exact mode (float32, unquantized, CPU):
    two nodes with the same string compute a step bit for bit alike. "" otherwise."""
    if dtype != torch.float32 or quant or device != "cpu":
        return ""
    return f"torch {torch.__version__} cpu {torch.backends.cpu.get_cpu_capability()} threads {torch.get_num_threads()}"


class Taps:
    def __init__(self, executor: ShardExecutor, lock: ComputeLock, node_id: str, kernels: str, counters: Counter):
        self.executor = executor
        self.lock = lock
        self.node_id = node_id
        self.kernels = kernels
        self.counters = counters  # the node's: taps and replays are counted here

    def tap(self, work: Work, result: StepResult,
            tokens: list[p.Token] | None = None) -> tuple[p.AuditTap, list[torch.Tensor]]:
        """The AUDIT_TAP of a step that ran: sketches of its input rows (q, SKETCH_DIM) and of its
        output (q rows of hidden states, or the tail's logits: one row, with the last of
        ``tokens``, the TOKENs sampled from them). A verification step's tail tap covers only the
        positions kept (drafts the tail rejected never reach an audit): its input rows up to
        the last token's, and that token's logits."""
        msg = work.msg
        self.counters["audit_taps"] += 1
        inputs, logits, sampled = work.tensor, result.logits, -1
        if result.verify is not None and tokens:
            inputs, logits = work.tensor[:, :len(tokens)], result.verify[len(tokens) - 1]  # (1, kept, hidden), (vocab,)
        with on_threads(1):  # a sketch is O(width): split, it waits on a core the next node may hold
            tensors = [sketch(inputs)]  # (q, SKETCH_DIM)
            if logits is not None:
                sampled = tokens[-1].token if tokens else sample(logits, msg.sampling, msg.pos + inputs.shape[1])
                tensors.append(sketch(logits))  # (1, SKETCH_DIM)
            elif result.hidden is not None:
                tensors.append(sketch(result.hidden))  # (q, SKETCH_DIM)
        tap = p.AuditTap(msg.audit, msg.session, msg.step, msg.pos, msg.start_layer, msg.end_layer, token=sampled)
        return tap, tensors

    def replay(self, job: Replay, tokens: int | None = None) -> tuple[p.AuditResult, list[torch.Tensor]] | None:
        """Run a queued AUDIT, or its next ``tokens`` positions (None: all that is left): layers
        start..end on its input from position 0, in a session that exists only for it. None
        while positions are left (the next call goes on), else the answer."""
        msg: p.Audit = job.msg
        n = job.tokens - job.done if tokens is None else min(tokens, job.tokens - job.done)
        self.counters["audit_replays"] += not job.done
        try:
            with self.lock:
                output = self.executor.replay(job.session, msg.start_layer, msg.end_layer,
                                              job.tensor[:, job.done:job.done + n],
                                              msg.logits_from if msg.logits_from >= 0 else job.tokens - 1, job.done)
                self.executor.finish()
        except Exception as exc:  # layers not held here, a shape the model refuses: the head asks another
            log.warning("could not re-run layers %d-%d for audit %s: %s", msg.start_layer, msg.end_layer,
                        msg.audit, exc)
            self.executor.kv.drop(job.session)
            return p.AuditResult(msg.audit, error=f"{type(exc).__name__}: {exc}"[:1024]), []
        job.done += n
        if output is not None:
            job.outputs.append(output)
        if job.done < job.tokens:
            return None
        self.executor.kv.drop(job.session)
        hidden = job.outputs[0].dim() == 3  # (1, q, hidden) slices, else the tail's (n, vocab)
        return p.AuditResult(msg.audit), [torch.cat(job.outputs, dim=1 if hidden else 0)]
