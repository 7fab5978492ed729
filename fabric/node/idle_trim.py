"""Hand the heap a node's requests freed back to the OS once the node has gone idle."""
from __future__ import annotations

from collections.abc import Callable

from ..compute.heap import release_freed_memory

IDLE_TRIM_S = 2.0  # seconds without a hop here before the freed heap goes back (a stream steps far more often)


class IdleTrim:
    """Once no hop ran for ``idle_s``, hand back what the hops freed (``malloc_trim``), once;
    the next hop arms it again.

    glibc keeps freed heap for the next allocation: a request's activations, logits and growing
    KV leave their high-water mark resident after it ends (a tail of the 1.7B shape in
    ``bench/models.py``: 19 MiB after one 64-token generation). A trim walks the heap and
    blocks the loop meanwhile (50 ms with nothing to hand back, 400 ms handing back 340 MiB of
    10,000 scattered chunks, on a 700 MiB heap here): after every hop it would cost each token
    that, when idle only a request arriving during it."""

    def __init__(self, trim: Callable[[], None] = release_freed_memory, idle_s: float = IDLE_TRIM_S):
        self.trim, self.idle_s = trim, idle_s
        self.last_work: float | None = None  # when a hop last ran; None: trimmed since

    def worked(self, now: float) -> None:
        self.last_work = now

    def tick(self, now: float, busy: bool) -> bool:
        """Trim if the node has been idle long enough since its last hop (``busy``: work is
        queued); whether it trimmed."""
        if busy or self.last_work is None or now - self.last_work < self.idle_s:
            return False
        self.last_work = None
        self.trim()
        return True
