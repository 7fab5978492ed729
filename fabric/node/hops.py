"""Running hops: one, or a batch, through the shard's executor under the compute lock.

A failure costs the sessions of that batch, never the node: each result is the step's
output or the exception it raised (a cache miss included), for the node to pass on.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter

import torch

from ..compute.compute_lock import ComputeLock, Members, current_cpu, on_cpu
from ..compute.executor import Chunk, ShardExecutor, Step, StepResult
from ..wire import protocol as p
from ..wire.shard import Shard
from .scheduler import HopScheduler, Work

log = logging.getLogger(__name__)

SLOW_HOP_S = 5.0  # a hop this long is logged: it stalls every session queued behind it
# One thread takes one-token passes where its step is at most this much slower than on every thread: the
# second thread's wake-ups at each hand-off between nodes cost more (docs/BENCHMARKS.md, "Threads for a
# one-token pass").
ONE_THREAD_SLACK = 1.02
TUNE_BUDGET_S = 3.0  # a shard whose check would take longer keeps every thread (its step is no small one)


def check_forward(msg: p.Forward, tensor: torch.Tensor, shard: Shard, hidden_size: int, context: int = 0,
                  vocab: int = 0) -> None:
    """ProtocolError unless ``shard`` can run ``msg``'s layers on ``tensor`` and pass them on,
    within the model's ``context`` (positions; 0: unchecked); token ids, for the first layer,
    within its ``vocab``. The limits are the wire's (``protocol.check_*``); what is checked
    here is which of them this node's model sets."""
    p.check_context(msg.pos, tensor.shape[1] if tensor.dim() > 1 else 0, context)
    if not shard.covers(msg.start_layer, msg.end_layer):
        raise p.ProtocolError(f"layers {msg.start_layer}-{msg.end_layer} are not on this node "
                              f"(it holds {shard})", p.ErrorCode.BAD_REQUEST)
    p.check_route_end(msg, shard.num_layers)
    if msg.start_layer > 0:
        p.check_hidden_size(tensor.shape[-1], hidden_size)
    elif tensor.is_floating_point() or tensor.dim() != 2 or tensor.numel() == 0:
        raise p.ProtocolError("layer 0 takes a (1, n) tensor of token ids", p.ErrorCode.BAD_REQUEST)
    else:
        p.check_vocab((int(tensor.min()), int(tensor.max())), vocab, "layer 0's input_ids")


@contextlib.contextmanager
def on_threads(n: int):
    """torch (and the kernels it drives) on ``n`` threads within, on as many as before after."""
    every = torch.get_num_threads()
    if n == every:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(every)


def decodes_at_once(device: str, quant: str | None, shard: Shard) -> bool:
    """Whether a node decodes at once by default (`meshnet node` without ``--decode-threads``): a
    quantized CPU node of a split model. Its streams then run as a pipeline of groups, one group's
    pass here while another's is at the next node, on this machine or another, where one gathered
    batch leaves every node but one idle (docs/BENCHMARKS.md, "Nodes started by hand pipeline
    too"). Not float weights (a float pass is bound by memory, and runs about as long for one
    stream as for eight), GPUs, or a node holding the whole model (no other node to keep busy)."""
    whole = shard.is_first and shard.is_last
    return device.partition(":")[0] == "cpu" and quant not in (None, "none") and not whole


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class HopRunner:
    def __init__(self, executor: ShardExecutor, lock: ComputeLock, counters: Counter, decode_threads: int = 0,
                 members: Members | None = None):
        self.executor = executor
        self.lock = lock
        self.counters = counters  # the node's: hops, batches, chunks and seconds are counted here
        self.step_threads = 0  # torch threads of a one-token pass (``tune_step_threads``); 0: as set for all
        self.decode_threads = decode_threads  # threads of a decode pass, run without the lock; 0: under it
        self.members = members  # with them, decode_threads is this node's share of the cores (``share_cores``)
        self._bare = False  # ``ready()`` let a decode pass run without the lock
        self._granted = False  # ``ready()`` said yes, and ``done()`` has not followed yet
        self._shared = (0, 0)  # the decode threads and the nodes sharing the cores, last logged
        self.share_cores()

    def share_cores(self) -> None:
        """With ``members`` (the nodes that share this machine's compute lock), decode on this node's
        share of the cores: its CPUs over the nodes there now, at most torch's threads. Nodes
        started by hand then decode at once as `meshnet up`'s do, and one alone on its machine
        decodes on all of them; a node that joins or leaves changes the share within a second."""
        if self.members is None:
            return
        nodes, cores = self.members.count(), _cpus()
        self.decode_threads = max(1, min(torch.get_num_threads(), cores // nodes))
        if (self.decode_threads, nodes) != self._shared:
            self._shared = (self.decode_threads, nodes)
            log.info("decode passes at once on %d thread(s): %d CPU(s) here, %d node(s) sharing them",
                     self.decode_threads, cores, nodes)

    def wait(self, scheduler: HopScheduler) -> float:
        """Seconds the loop may poll for: until the queued work is due, else 50 ms (a compute
        lock granted meanwhile ends the poll at once: its ``fileno()`` is polled). Decode steps
        that run without the lock wait for no grant."""
        if not len(scheduler) or (self.lock.pending and not (self.decode_threads and scheduler.narrow())):
            return 0.05
        return scheduler.wait(time.monotonic())

    def ready(self, scheduler: HopScheduler) -> bool:
        """Whether a batch may run now, never blocking: one is due (or the compute lock was
        awaited for one) and this node holds the lock (``done()`` lets it go). While another
        node of this machine holds it, a thread waits for it and the loop goes on answering
        pings and heartbeats; the batch is picked once the lock is granted, from what is
        queued then.

        With ``decode_threads``, a batch of decode steps alone (or with prompts' last few tokens:
        ``Work.light``) runs at once, without the lock, on that many threads: nodes of one
        machine then decode at the same time, each on its share of the cores (a decode pass
        gains little from more threads: its products are small), while other prompts,
        verification steps and replays take the lock and every thread (docs/BENCHMARKS.md,
        "Decode passes at once")."""
        if self.decode_threads and scheduler.narrow() and scheduler.wait(time.monotonic()) == 0:
            self._bare = self._granted = True
            return True
        asked = self.lock.pending
        if not asked and not (len(scheduler) and scheduler.wait(time.monotonic()) == 0):
            return False
        if self.lock.request():
            self._granted = True
            return True
        if not asked:
            self.counters["lock_waits"] += 1
        return False

    def done(self) -> None:
        """Let the compute lock ``ready()`` took go, once per grant: as soon as the pass has run,
        before its results are sent (the node they go to may share this machine's lock), and
        again, doing nothing, after them."""
        if not self._granted:
            return
        self._granted = False
        if self._bare:
            self._bare = False
        else:
            self.lock.release()

    def run(self, batch: list[Work]) -> tuple[list[StepResult | Exception], float, float]:
        """Run ``batch`` (one hop; decode steps over the same layers, perhaps with prompts'
        chunks riding last; or short chunks of prompts); returns a result per hop, when it
        began and how long it took (perf_counter). Between ``ready()`` and ``done()`` the
        lock is held already; otherwise ``run`` blocks until it is."""
        bare = self._bare and all(w.light for w in batch)
        threads = self._threads(batch, bare)
        with contextlib.nullcontext() if bare else self.lock, on_threads(threads), self._warm_cpu(bare, threads):
            started = time.perf_counter()
            try:
                results = self._run(batch)
                self.executor.finish()
            except Exception as exc:
                log.exception("hop failed for sessions %s", [w.session for w in batch])
                results = [exc] * len(batch)
        elapsed = time.perf_counter() - started
        self._count(batch, elapsed)
        return results, started, elapsed

    @contextlib.contextmanager
    def _warm_cpu(self, bare: bool, threads: int):
        """A one-thread pass that takes its turn from another node under a shared compute lock
        runs on the CPU that node's pass ran on, and notes its own: a core that has just
        computed runs the next pass faster than one woken from idle (the same steps took 1.11x
        as long in two processes taking turns, each waking on a CPU of its own, and 0.99x
        pinned to one; docs/BENCHMARKS.md, "The core that computed last")."""
        if bare or threads != 1 or not self.lock.shared:
            yield
            return
        with on_cpu(self.lock.handed_cpu()):
            yield
            self.lock.note_cpu(current_cpu())

    def _run(self, batch: list[Work]) -> list[StepResult | Exception]:
        if len(batch) == 1:
            msg = batch[0].msg
            try:
                return [self.executor.run(msg.session, msg.start_layer, msg.end_layer, batch[0].tensor, msg.pos,
                                          logits=not msg.more, reuse=msg.reuse, drafts=len(msg.drafts),
                                          guess=msg.guess >= 0)]
            except Exception as exc:  # CacheMissError included: the node answers per session
                return [exc]
        steps = [Step(w.session, w.msg.start_layer, w.msg.end_layer, w.tensor, w.msg.pos, len(w.msg.drafts),
                      w.msg.guess >= 0) for w in batch]
        if all(w.short_prompt for w in batch):
            return self.executor.run_prefills(steps)  # whole prompts from scratch: one padded batch
        decode = sum(w.decode for w in batch)  # then prompts' chunks riding in the same pass, if any
        if decode == len(batch):
            return self.executor.run_batch(steps)
        return self.executor.run_mixed(steps[:decode], [Chunk(step, logits=not w.msg.more, reuse=w.msg.reuse)
                                                        for step, w in zip(steps[decode:], batch[decode:])])

    def _count(self, batch: list[Work], elapsed: float) -> None:
        self.counters["hops"] += len(batch)
        self.counters["batched_hops"] += len(batch) if len(batch) > 1 else 0
        self.counters["prefill_chunks"] += batch[-1].msg.more
        self.counters["riding_chunks"] += sum(not w.decode for w in batch) if batch[0].decode else 0
        self.counters["hop_seconds"] += elapsed
        self.counters["rolled_back"] = self.executor.rolled_back
        if elapsed > SLOW_HOP_S:
            first = batch[0]
            log.warning("a hop of %d session(s) took %.1f s (layers %d-%d, %d tokens at position %d)", len(batch),
                        elapsed, first.msg.start_layer, first.msg.end_layer, first.tokens, first.msg.pos)

    def _threads(self, batch: list[Work], bare: bool) -> int:
        """The torch threads ``batch`` runs on: ``step_threads`` for a one-token pass, where set (and
        fewer than a bare pass may take); ``decode_threads`` for another decode pass without the lock;
        else every thread."""
        one_token = len(batch) == 1 and batch[0].tokens == 1
        every = self.decode_threads if bare else torch.get_num_threads()
        return min(self.step_threads, every) if self.step_threads and one_token else every

    def tune_step_threads(self, shard: Shard, dtype: torch.dtype, reps: int = 5) -> int:
        """Run one-token passes on one thread where this shard's one-token step is no slower on it
        than on all of torch's threads (within ``ONE_THREAD_SLACK``; best of ``reps`` each,
        alternated, under the compute lock). A pass of one row leaves a second thread little to
        do, and each pass wakes it, on cores the node that hands it the next step may still use.
        Its bits are what a one-thread run of the same code gives. Returns the choice (0: every
        thread). Prompts, batches and verification steps keep every thread."""
        every = torch.get_num_threads()
        if every == 1:
            return 0
        best = {1: float("inf"), every: float("inf")}
        try:
            with self.lock:
                if self._step(shard, dtype) * 2 * reps > TUNE_BUDGET_S:  # (a warm-up too)
                    return 0
                for _ in range(reps):
                    for n in best:
                        with on_threads(n):
                            best[n] = min(best[n], self._step(shard, dtype))
        finally:
            self.executor.kv.drop("__bench__")
        self.step_threads = 1 if best[1] <= best[every] * ONE_THREAD_SLACK else 0
        log.info("a one-token step of layers %s: %.1f ms on one thread, %.1f ms on %d: one-token passes on %s",
                 shard, best[1] * 1e3, best[every] * 1e3, every, "one thread" if self.step_threads else f"{every}")
        return self.step_threads

    def benchmark(self, shard: Shard, dtype: torch.dtype, reps: int = 3) -> float:
        """Layer-steps per second for one decode token on a fixed workload."""
        best = min(self._step(shard, dtype) for _ in range(reps))
        self.executor.kv.drop("__bench__")
        return shard.size / max(best, 1e-9)

    def _step(self, shard: Shard, dtype: torch.dtype) -> float:
        """Seconds for one token through the shard from position 0 (session ``__bench__``)."""
        ex = self.executor
        x = (torch.zeros((1, 1), dtype=torch.int64) if shard.is_first
             else torch.zeros((1, 1, ex.hidden_size), dtype=dtype))
        t = time.perf_counter()
        ex.run("__bench__", shard.start, shard.end, x, 0)
        ex.finish()
        return time.perf_counter() - t
