"""The node loop's housekeeping pace (fabric/node/housekeeping.py)."""
from fabric.node.housekeeping import Housekeeping


def test_a_sweep_at_most_once_per_period():
    h = Housekeeping(every=0.005)
    assert h.due(10.0)
    assert not h.due(10.001) and not h.due(10.004)
    assert h.due(10.005)


def test_a_skipped_sweep_ends_the_next_poll_when_it_falls_due():
    h = Housekeeping(every=0.005)
    assert h.bound(0.05, 10.0) == 0.05  # nothing owed: the loop's own wait
    h.due(10.0)
    assert h.bound(0.05, 10.001) == 0.05  # swept just now, no wake skipped one
    assert not h.due(10.001)  # a frame woke the loop: the sweep is owed
    assert abs(h.bound(0.05, 10.001) - 0.004) < 1e-9
    assert h.bound(0.0, 10.001) == 0.0  # work due now still runs at once
    assert h.bound(0.05, 10.0049) == 0.001  # never a busy poll of 0 ms for an owed sweep
    assert h.due(10.006) and h.bound(0.05, 10.006) == 0.05  # paid: back to the loop's wait
