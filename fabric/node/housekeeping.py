"""How often the node loop does its housekeeping (``Node._periodic``)."""
from __future__ import annotations

HOUSEKEEPING_S = 0.02  # at most once per this many seconds while frames keep the loop awake


class Housekeeping:
    """Paces the loop's housekeeping: timers, pings, pruning, the routes a head watches.

    The loop wakes for every frame: a FORWARD in, a TOKEN back, a pong, a heartbeat's answer.
    Housekeeping after each wake cost a 2-node route's head 0.6-0.9 ms of CPU a token on a busy
    machine (four sweeps a token, each draining every peer's socket and walking every session),
    work that a 20 ms tick does as well (pings go out every second). A sweep a wake skipped is owed: the poll
    that follows ends when it falls due, so a client's cancel or a dead peer waits at most
    ``every`` seconds, and an idle loop (woken by nothing) wakes no more often than before.
    """

    def __init__(self, every: float = HOUSEKEEPING_S):
        self.every = every
        self._last = float("-inf")  # when the last sweep ran
        self._owed = False  # a wake since then skipped one

    def due(self, now: float) -> bool:
        """Whether to sweep now; a wake that may not is remembered (see ``bound``)."""
        if now - self._last >= self.every:
            self._last, self._owed = now, False
            return True
        self._owed = True
        return False

    def bound(self, wait: float, now: float) -> float:
        """The poll's ``wait`` in seconds, cut to when an owed sweep falls due."""
        if not self._owed:
            return wait
        return min(wait, max(0.001, self._last + self.every - now))
