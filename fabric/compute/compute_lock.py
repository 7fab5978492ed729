"""One machine, several nodes: a file lock so they compute one at a time.

Nodes that share a machine (``meshnet up`` starts them so) otherwise compute at once
whenever their sessions are out of step, each with every core's worth of torch threads,
and then run slower together than one at a time. Holding an exclusive ``flock`` on a
shared file while running layers lets each node use every core in its turn. The kernel
frees the lock when a process dies, so a killed node never blocks the others.
"""
from __future__ import annotations

import fcntl
import os


class ComputeLock:
    """``with lock:`` holds the file lock at ``path``; with no path it does nothing."""

    def __init__(self, path: str | None):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path else None

    @property
    def shared(self) -> bool:
        """Other nodes may wait for this lock: there is a file."""
        return self._fd is not None

    def __enter__(self) -> "ComputeLock":
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
