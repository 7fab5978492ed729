"""The hop scheduler alone: no model, no node, no sockets and no torch. Hops are FORWARDs
with a stand-in input of which only the token count matters; the clock is a number."""
from __future__ import annotations

import pytest

from fabric.node.scheduler import (
    GATHER_PER_DECODE,
    IDLE_SLICE_S,
    MIN_SLICE_TOKENS,
    RECENT_CYCLES,
    RIDE_PER_DECODE,
    WAITING_REPORT_S,
    WHOLE_PREFILL_TOKENS,
    HopScheduler,
    SchedulerConfig,
    Work,
)
from fabric.wire import protocol as p


class Tokens:
    """Stands in for an input tensor (1, n): a shape, and slices along the tokens."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop
        self.shape = (1, stop - start)

    def __getitem__(self, index: tuple[slice, slice]) -> "Tokens":
        part = index[1]
        lo = self.start + (part.start or 0)
        hi = self.stop if part.stop is None else self.start + part.stop
        return Tokens(lo, hi)


def work(session: str, pos: int, q: int, more: bool = False, span: tuple[int, int] = (0, 1)) -> Work:
    msg = p.Forward(session=session, step=0, pos=pos, start_layer=span[0], end_layer=span[1], route=(),
                    reply_to="x", more=more)
    return Work(msg, Tokens(0, q))


def scheduler(queue: list[Work] = (), live=(), busy: float = 32, idle: float = 32, decode_s: float | None = None,
              cycle_s: float | None = None, locked: bool = False, ride: float = 32, **config) -> HopScheduler:
    s = HopScheduler(SchedulerConfig(**config), set(live), shared_lock=locked)
    for w in queue:
        s.push(w)
    s.slice_tokens = {"ride": float(ride), "busy": float(busy), "idle": float(idle)}
    s.decode_batch_s, s.pass_s, s.cycle_s = decode_s, decode_s, cycle_s
    return s


def test_the_scheduler_needs_neither_torch_nor_sockets():
    import fabric.node.scheduler as module

    assert "torch" not in vars(module) and "zmq" not in vars(module)
    assert {"torch", "zmq"}.isdisjoint(m.split(".")[0] for m in _imports(module.__file__))


def _imports(path: str) -> set[str]:
    import ast

    tree = ast.parse(open(path).read())
    return ({a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level})


def take_all(queue: list[Work]) -> list[tuple[str, int]]:
    """The order hops run in, one at a time (as if nothing batched)."""
    s, order = scheduler(queue), []
    while len(s):
        w = s.take(decode=s.ran_prefill)
        s.ran_prefill = not w.decode
        order.append((w.session, w.msg.pos))
    return order


def test_prefill_chunks_and_decode_steps_take_turns():
    queue = [work("long", 0, 8, more=True), work("long", 8, 8, more=True), work("long", 16, 8),
             work("a", 40, 1), work("b", 50, 1)]
    # a chunk, then a decode step, a chunk, a decode step: neither kind waits for the other to drain
    assert take_all(queue) == [("long", 0), ("a", 40), ("long", 8), ("b", 50), ("long", 16)]


def test_the_sessions_waiting_in_the_queue_are_named_every_so_often():
    """Their heads hear that these steps wait their turn here (PROGRESS): the first queued
    hop of each session, at most once every WAITING_REPORT_S."""
    s = scheduler([work("long", 64, 32, more=True), work("a", 40, 1, span=(2, 3)), work("long", 96, 32),
                   work("b", 50, 1, span=(2, 3))])
    assert [(w.session, w.msg.pos) for w in s.waiting(100.0)] == [("long", 64), ("a", 40), ("b", 50)]
    assert s.waiting(100.0 + WAITING_REPORT_S / 2) == []
    assert s.next_batch()[0].session == "long"  # its first chunk ran: its next one waits behind "a" now
    assert [(w.session, w.msg.pos) for w in s.waiting(100.0 + WAITING_REPORT_S)] == [("a", 40), ("long", 96),
                                                                                   ("b", 50)]


def test_a_sessions_hops_never_overtake_each_other():
    # a stale decode step of "s" queued before its re-prefill: it must still run first
    queue = [work("s", 30, 1), work("s", 0, 4, more=True), work("s", 4, 4), work("t", 9, 1)]
    order = take_all([work("x", 0, 4)] + queue)  # after a prefill, decode steps are preferred
    assert [o for o in order if o[0] == "s"] == [("s", 30), ("s", 0), ("s", 4)]


def test_a_long_prefill_is_cut_and_the_rest_queued_first():
    s = scheduler([work("a", 40, 1)], ["a"], busy=25, idle=500)  # "a" decodes here: busy
    first = s.slice(work("long", 0, 100))
    assert first.tokens == 25 and first.msg.pos == 0 and first.msg.more
    rest = s.queue[0]
    assert rest.session == "long" and rest.msg.pos == 25 and rest.tokens == 75 and not rest.msg.more
    assert (first.tensor.start, first.tensor.stop, rest.tensor.start, rest.tensor.stop) == (0, 25, 25, 100)


def test_alone_a_prefill_uses_the_idle_size_and_short_ones_go_whole():
    assert scheduler(busy=8, idle=125).slice(work("long", 0, 1000)).tokens == 125
    short = scheduler(busy=8, idle=125)
    assert short.slice(work("short", 0, 100)).msg.more is False and not len(short)


def test_the_last_slice_keeps_the_chunk_flag_it_came_with():
    s = scheduler(live=["x"], busy=5)
    first = s.slice(work("long", 10, 70, more=True))
    assert (first.tokens, first.msg.more) == (5, True)
    assert (s.queue[0].msg.pos, s.queue[0].msg.more) == (15, True)


def test_a_prompt_under_two_slices_or_a_short_one_goes_whole():
    # cut, its rest (or every piece) would be too small to pay for reading the weights once more
    s = scheduler([work("a", 40, 1)], ["a"], busy=40)
    whole = s.slice(work("short", 0, 79))
    assert whole.tokens == 79 and not whole.msg.more and len(s) == 1
    small = scheduler([work("a", 40, 1)], ["a"], busy=8)
    assert small.slice(work("short", 0, WHOLE_PREFILL_TOKENS - 1)).tokens == WHOLE_PREFILL_TOKENS - 1
    assert small.slice(work("long", 0, WHOLE_PREFILL_TOKENS)).tokens == 8


def test_slices_are_steered_toward_one_decode_step_beside_streams():
    s = scheduler(live=["a"], busy=80, decode_s=0.05)
    s.steer_slices("long", 80, elapsed=0.2)  # 4x too long: halve (at most 2x a step)
    assert s.slice_tokens["busy"] == 40
    s.steer_slices("long", 40, elapsed=0.04)  # a bit short: grow in proportion
    assert s.slice_tokens["busy"] == 50
    s.steer_slices("long", 7, elapsed=0.5)  # a remainder: no information
    assert s.slice_tokens["busy"] == 50
    s.slice_tokens["busy"] = MIN_SLICE_TOKENS + 1
    s.steer_slices("long", MIN_SLICE_TOKENS + 1, elapsed=5.0)  # never below the minimum
    assert s.slice_tokens["busy"] == MIN_SLICE_TOKENS
    alone = scheduler(idle=40)
    alone.steer_slices("long", 40, elapsed=IDLE_SLICE_S / 8)  # alone the target is IDLE_SLICE_S
    assert alone.slice_tokens["idle"] == 80


def test_a_configured_slice_time_is_the_target_beside_streams():
    s = scheduler(live=["a"], busy=40, decode_s=0.05, prefill_slice=0.1)
    s.steer_slices("long", 40, elapsed=0.08)
    assert s.slice_tokens["busy"] == 50


def test_short_prompts_queued_together_run_as_one_batch():
    queue = [work("a", 0, 30), work("x", 40, 1, span=(2, 3)), work("b", 0, 20), work("long", 0, 500),
             work("c", 0, 40), work("d", 0, 200)]
    s = scheduler(queue, ["x"], busy=8)
    batch = s.next_batch()
    # "d" would take the batch past PREFILL_BATCH_TOKENS; the long prompt runs alone, in slices
    assert [w.session for w in batch] == ["a", "b", "c"]
    assert [w.session for w in s.queue] == ["x", "long", "d"]


def test_a_prompt_slice_rides_in_the_decode_batch():
    """Decode steps go with a slice of the first queued prompt over the same layers, in one
    pass, and then with the next slice: the prompt moves on at every decode batch."""
    queue = [work("long", 0, 500), work("a", 40, 1), work("b", 50, 1), work("other", 0, 300, span=(2, 3))]
    s = scheduler(queue, ["a", "b"], ride=100, busy=8)
    batch = s.next_batch()
    assert [(w.session, w.msg.pos, w.tokens, w.msg.more) for w in batch] == [("a", 40, 1, False), ("b", 50, 1, False),
                                                                           ("long", 0, 100, True)]
    assert [(w.session, w.msg.pos) for w in s.queue] == [("long", 100), ("other", 0)]
    s.push(work("a", 41, 1))
    assert [w.session for w in s.next_batch()] == ["a", "long"]
    assert [(w.session, w.msg.pos) for w in s.queue] == [("long", 200), ("other", 0)]
    alone = s.next_batch()  # no decode step queued: a slice alone, the other prompt riding nothing
    assert [(w.session, w.msg.pos, w.tokens) for w in alone] == [("long", 200, 8)]
    s.push(work("a", 42, 1))
    assert [w.session for w in s.next_batch()] == ["a", "long"]  # not "other": another span
    short = scheduler([work("a", 43, 1), work("p", 0, 30), work("q", 0, 20, span=(2, 3)), work("r", 0, 50),
                       work("r", 50, 5), work("s", 0, 200), work("t", 0, 40)], ["a"])
    # whole short prompts ride together, up to PREFILL_BATCH_TOKENS; a session's later hop stays behind
    assert [w.session for w in short.next_batch()] == ["a", "p", "r", "t"]
    assert [w.session for w in short.queue] == ["q", "r", "s"]
    cannot = HopScheduler(SchedulerConfig(), {"a"}, batchable=lambda start, end: False)
    for w in (work("long", 0, 500), work("a", 40, 1)):
        cannot.push(w)
    assert [w.session for w in cannot.next_batch()] == ["long"]  # taking turns instead
    assert [w.session for w in cannot.next_batch()] == ["a"]


def test_a_riding_slice_is_steered_by_what_it_adds_to_the_pass():
    s = scheduler(live=["a"], ride=80, decode_s=0.05)
    target = RIDE_PER_DECODE * 0.05
    batch = [work("a", 40, 1), work("long", 0, 80, more=True)]
    s.ran(batch, started=1.0, elapsed=0.05 + 2 * target)  # it added twice the target: halve
    assert s.slice_tokens["ride"] == pytest.approx(40) and s.decode_batch_s == 0.05 and s.last_decode == {"a": 1.0}
    assert s.pass_s > 0.05  # a decode batch waits for late sessions in proportion to its passes, slice and all
    s.ran([work("a", 41, 1), work("long", 80, 40, more=True)], started=1.2, elapsed=0.05 + target / 2)
    # one pass moves the cost per token by 0.3 of what it saw (half the last one's): not twofold
    assert s.slice_tokens["ride"] == pytest.approx(40 / (0.7 + 0.3 * 0.5))
    s.ran([work("a", 42, 1), work("long", 120, 5)], started=1.4, elapsed=1.0)  # a remainder: no information
    assert s.slice_tokens["ride"] == pytest.approx(40 / 0.85)
    fresh = scheduler(live=["a"], ride=80)  # no decode batch timed yet: no telling what the slice added
    fresh.ran(batch, started=1.0, elapsed=0.5)
    assert fresh.slice_tokens["ride"] == 80
    configured = scheduler(live=["a"], ride=80, decode_s=0.05, prefill_slice=0.2)
    configured.ran(batch, started=1.0, elapsed=0.05 + 0.1)
    assert configured.slice_tokens["ride"] == pytest.approx(160)  # --prefill-slice-ms sets what a slice may add


def test_decode_steps_batch_up_to_the_limit_over_the_same_layers_only():
    queue = [work(f"s{i}", 10, 1) for i in range(5)] + [work("other", 10, 1, span=(2, 3)), work("s0", 11, 1)]
    s = scheduler(queue, max_batch=4)
    s.ran_prefill = True  # a decode batch goes next
    assert [w.session for w in s.next_batch()] == ["s0", "s1", "s2", "s3"]
    assert [w.session for w in s.queue] == ["s4", "other", "s0"]  # a session's second step waits its turn


def test_hops_that_cannot_share_a_pass_run_alone():
    s = HopScheduler(SchedulerConfig(), set(), batchable=lambda start, end: False)
    for name in "ab":
        s.push(work(name, 10, 1))
    assert [w.session for w in s.next_batch()] == ["a"] and len(s) == 1


def test_a_decode_batch_waits_a_little_for_sessions_due_here():
    def gathering():
        s = scheduler([work("a", 40, 1)], ["a", "b"], decode_s=0.04, cycle_s=0.1)
        s.last_decode = {"a": 9.9, "b": 9.95}
        return s

    s = gathering()
    assert s.wait(10.0) == pytest.approx(GATHER_PER_DECODE * 0.04)  # "b" decoded here just now
    assert 0 < s.wait(10.01) < GATHER_PER_DECODE * 0.04  # the same wait, not a new one
    s.push(work("b", 50, 1))
    assert s.wait(10.011) == 0  # everyone due is here: run
    late = gathering()
    late.wait(10.0)
    assert late.wait(10.0 + GATHER_PER_DECODE * 0.04) == 0  # waited long enough: run without "b"


def test_a_session_that_does_not_come_back_is_waited_for_once():
    """A stream whose head is failing over (or gone) decoded here lately but sends nothing:
    the node waits for it once, then not again until it decodes here again. Waiting each
    time would stretch every other stream's cycle, and with it the wait (a stall that fed
    itself to 0.1 tok/s under chaos)."""
    s = scheduler([work("a", 40, 1)], ["a", "gone"], decode_s=0.04, cycle_s=0.1, locked=True)
    s.last_decode = {"a": 9.9, "gone": 9.95}
    assert s.wait(10.0) == pytest.approx(0.1)
    assert s.wait(10.1) == 0 and "gone" not in s.last_decode
    s.ran(s.next_batch(), started=10.1, elapsed=0.04)
    s.push(work("a", 41, 1))
    assert s.wait(10.2) == 0  # nothing due is missing now: run at once


def test_after_a_merge_wait_in_vain_decode_batches_wait_only_a_pass_for_a_while():
    """Two groups of streams, each queued at the node the other waits on (after a failover):
    a cycle-long wait for the other group runs out, then for RECENT_CYCLES cycles a batch
    waits only a pass's time, so the two nodes do not wait on each other at every token."""
    s = scheduler([work("a", 40, 1)], ["a", "b"], decode_s=0.04, cycle_s=0.5, locked=True)
    s.last_decode = {"a": 9.9, "b": 9.95}
    assert s.wait(10.0) == pytest.approx(0.5)
    assert s.wait(10.5) == 0  # in vain: "b" stayed queued elsewhere
    s.ran(s.next_batch(), started=10.5, elapsed=0.04)
    s.last_decode["b"] = 10.6  # "b" came back and ran here alone; "a" is queued again
    s.push(work("a", 41, 1))
    assert s.wait(10.7) == pytest.approx(GATHER_PER_DECODE * 0.04)  # a pass's time, not a cycle
    assert s.wait(10.7 + GATHER_PER_DECODE * 0.04) == 0
    later = 10.5 + RECENT_CYCLES * 0.5
    s.last_decode["b"] = later - 0.4  # "b" ran here again meanwhile
    assert s.wait(later) == pytest.approx(s.cycle_s)  # later, merging is tried again


def test_one_stall_moves_the_learnt_cycle_by_two_cycles_at_most():
    s = scheduler(live=["a"], cycle_s=0.1)
    s.last_decode = {"a": 1.0}
    s.ran([work("a", 10, 1)], started=31.0, elapsed=0.05)  # 30 s since its last step here
    assert s.cycle_s == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))


def test_nothing_waits_for_sessions_gone_quiet_freed_or_beside_a_prefill():
    stale = scheduler([work("a", 40, 1)], ["a", "b"], decode_s=0.04, cycle_s=0.1)
    stale.last_decode = {"a": 9.9, "b": 9.0}  # "b" last decoded 10 cycles ago
    assert stale.wait(10.0) == 0
    freed = scheduler([work("a", 40, 1)], ["a"], decode_s=0.04, cycle_s=0.1)  # "b" closed: its KV is gone
    freed.last_decode = {"a": 9.9, "b": 9.95}
    assert freed.wait(10.0) == 0
    freed.forget_freed()
    assert freed.last_decode == {"a": 9.9}
    prefill = scheduler([work("a", 40, 1), work("new", 0, 30, span=(2, 3))], ["a", "b"], decode_s=0.04, cycle_s=0.1)
    prefill.last_decode = {"a": 9.9, "b": 9.95}
    assert prefill.wait(10.0) == 0  # a prefill that cannot ride with them runs in the meantime instead
    riding = scheduler([work("a", 40, 1), work("new", 0, 30)], ["a", "b"], decode_s=0.04, cycle_s=0.1)
    riding.last_decode = {"a": 9.9, "b": 9.95}
    assert riding.wait(10.0) == pytest.approx(GATHER_PER_DECODE * 0.04)  # one that can waits with them


def test_under_a_compute_lock_a_slice_waits_for_the_streams_to_come_back():
    # another slice now would hold the machine while the other node has their decode steps
    s = scheduler([work("long", 64, 500)], ["a", "b"], decode_s=0.04, cycle_s=0.1, locked=True)
    s.last_decode, s.ran_prefill = {"a": 9.9, "b": 9.95}, True
    assert s.wait(10.0) == pytest.approx(0.1)  # up to one cycle of theirs
    assert s.wait(10.1) == 0
    s.push(work("a", 40, 1))
    s.push(work("b", 50, 1))
    assert s.wait(10.0) == 0  # the whole group is back: its decode batch goes first, the slice riding
    split = scheduler([work("a", 40, 1)], ["a", "b"], decode_s=0.04, cycle_s=0.1, locked=True)
    split.last_decode = {"a": 9.9, "b": 9.95}
    assert split.wait(10.0) == pytest.approx(0.1)  # a decode batch too: "b" comes back within a cycle, so merge
    unlocked = scheduler([work("long", 64, 500)], ["a"], decode_s=0.04, cycle_s=0.1)
    unlocked.last_decode, unlocked.ran_prefill = {"a": 9.9}, True
    assert unlocked.wait(10.0) == 0  # its own machine: the slice fills the gap


def test_timing_learns_the_decode_rhythm_and_drop_forgets_a_session():
    s = scheduler(live=["a", "b"])
    s.ran([work("a", 10, 1), work("b", 10, 1)], started=1.0, elapsed=0.05)
    s.ran([work("a", 11, 1), work("b", 11, 1)], started=1.2, elapsed=0.05)
    assert s.decode_batch_s == pytest.approx(0.05) and s.cycle_s == pytest.approx(0.2)
    s.push(work("a", 12, 1))
    s.push(work("b", 12, 1))
    s.drop("a")
    assert [w.session for w in s.queue] == ["b"] and s.last_decode == {"b": 1.2}



def test_a_verification_step_takes_the_streams_turn_between_a_long_prompts_slices():
    """A verification step (a decode step and its drafts) is no decode step, but it is a stream's:
    between slices of a long prompt it runs, where it once waited behind every slice (a stream
    that drafted stood still for the whole prefill: 7-8 s on 2,000 tokens)."""
    msg = p.Forward(session="v", step=0, pos=40, start_layer=0, end_layer=1, route=(), reply_to="x", drafts=(7, 8))
    s = scheduler([work("long", 0, 2000)], ["v"], busy=32)
    first = s.next_batch()
    assert [(w.session, w.tokens) for w in first] == [("long", 32)]
    s.push(Work(msg, Tokens(0, 3)))
    assert [w.session for w in s.next_batch()] == ["v"]  # the streams' turn
    assert [w.session for w in s.next_batch()] == ["long"]  # then the prompt's
