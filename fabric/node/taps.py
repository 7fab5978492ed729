"""The hop's side of audits: report an audited step to the head, re-run one for another head.

A head audits a step that starts a session at position 0 by naming one hop in the FORWARD
(``audit``: that hop's first layer). That hop runs the step as usual, alone (``Work.tapped``
keeps it out of batches, so a replica computes it in the same order), passes its output on,
and sends the head an AUDIT_TAP with the input it received and the output it computed: of
the step, or of its first prefill chunk when the node cuts a long prompt into slices (the
tail then computes that chunk's logits for the tap alone). The
head then sends the input to replicas holding the same layers as an AUDIT; a replica runs it
in a session of its own from position 0, frees it at once, and answers AUDIT_RESULT.
No sockets here: the node sends what these return.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

from ..compute.compute_lock import ComputeLock
from ..compute.executor import ShardExecutor, StepResult
from ..wire import protocol as p
from .scheduler import Work

log = logging.getLogger(__name__)

def kernels(device: str, dtype: torch.dtype, quant: str | None) -> str:
    """What decides the bits of this node's output in exact mode (float32, unquantized, CPU):
    two nodes with the same string compute a step bit for bit alike. "" otherwise: compared
    within a tolerance."""
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

    def tap(self, work: Work, result: StepResult) -> tuple[p.AuditTap, list[torch.Tensor]]:
        """The AUDIT_TAP for a tapped hop that ran (a tapped chunk on the tail ran with logits):
        its input and output, hidden states or the tail's logits."""
        msg = work.msg
        self.counters["audit_taps"] += 1
        output = result.logits if result.logits is not None else result.hidden
        tap = p.AuditTap(msg.session, msg.step, self.node_id, msg.start_layer, msg.end_layer, kernels=self.kernels,
                         more=msg.more)
        return tap, [work.tensor, output]  # (1, q, hidden) in; (1, q, hidden) or (vocab,) out

    def replay(self, msg: p.Audit, inputs: torch.Tensor) -> tuple[p.AuditResult, list[torch.Tensor]]:
        """Run an AUDIT: layers start..end on ``inputs`` (1, q, hidden) from position 0, in a
        session that exists only for this call."""
        session = f"audit:{msg.audit}"
        self.counters["audit_replays"] += 1
        try:
            with self.lock:
                result = self.executor.run(session, msg.start_layer, msg.end_layer, inputs, 0)
                self.executor.finish()
        except Exception as exc:  # layers not held here, a shape the model refuses: the head asks another
            log.warning("could not re-run layers %d-%d for audit %s: %s", msg.start_layer, msg.end_layer,
                        msg.audit, exc)
            error = f"{type(exc).__name__}: {exc}"[:1024]
            return p.AuditResult(msg.audit, self.node_id, kernels=self.kernels, error=error), []
        finally:
            self.executor.kv.drop(session)
        output = result.logits if result.logits is not None else result.hidden
        return p.AuditResult(msg.audit, self.node_id, kernels=self.kernels), [output]
