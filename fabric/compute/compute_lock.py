"""One machine, several nodes: a file lock so they compute one at a time.

Nodes that share a machine otherwise compute at once whenever their sessions are out of
step, each with every core's worth of torch threads, and then run slower together than one
at a time. Holding an exclusive ``flock`` on a shared file while running layers lets each
node use every core in its turn. The kernel frees the lock when a process dies, so a killed
node never blocks the others.

By default every node of one user on one device locks the same file (``default_path``), so
nodes started one by one coordinate as ``meshnet up``'s do; ``--compute-lock`` names
another file, or ``none``.
"""
from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Mapping
from pathlib import Path

NO_LOCK = "none"  # --compute-lock none: this node computes whenever it likes


class LockDirError(Exception):
    """The default lock's directory cannot be made private to this user."""


def default_path(device: str, env: Mapping[str, str], uid: int | None = None) -> Path:
    """The lock file of ``device`` shared by this user's nodes on this machine:
    ``$XDG_RUNTIME_DIR/meshnet/compute-cpu.lock``, else ``/tmp/meshnet-UID/compute-cpu.lock``.
    ``cuda`` is ``cuda:0`` (torch's first device), so both name one file."""
    name = "cuda:0" if device == "cuda" else device
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "meshnet" if runtime else Path("/tmp") / f"meshnet-{os.getuid() if uid is None else uid}"
    return base / f"compute-{name.replace(':', '')}.lock"


def private_dir(path: Path) -> None:
    """Make ``path``'s directory (mode 0700) unless it exists; refuse one that another user
    owns or may write to (they could hold or swap the lock)."""
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        raise LockDirError(f"cannot make {directory} for the compute lock: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise LockDirError(f"{directory} is not a directory only this user may write to")


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
