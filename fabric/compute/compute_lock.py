"""One machine, several nodes: a file lock so they compute one at a time.

Nodes that share a machine otherwise compute at once whenever their sessions are out of
step, each with every core's worth of torch threads, and then run slower together than one
at a time. Holding an exclusive ``flock`` on a shared file while running layers lets each
node use every core in its turn. The kernel frees the lock when a process dies, so a killed
node never blocks the others.

Waiting for the lock must not silence a node: its loop answers pings and heartbeats, and
a neighbour's long prefill can hold the lock for many seconds. So the loop asks without
blocking (``ComputeLock.request``) and a thread of the lock's own waits in its stead.

By default every node of one user on one device locks the same file (``default_path``), so
nodes started one by one coordinate as ``meshnet up``'s do; ``--compute-lock`` names
another file, or ``none``.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

NO_LOCK = "none"  # --compute-lock none: this node computes whenever it likes
RECOUNT_S = 1.0  # Members.count() looks at the directory at most this often


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
    """The file lock at ``path``, held one of two ways; with no path it does nothing.

    ``with lock:`` blocks until it is held (scripts, tests, an audit's replay). The node's
    loop never blocks on it: ``request()`` takes it when it is free, else a waiter thread
    blocks in ``flock`` in the loop's stead and makes ``fileno()`` readable once it holds
    it, so the loop polls that fd beside its sockets and answers pings and heartbeats while
    another node computes. ``flock`` locks belong to the open file, not a thread: the waiter
    takes it, the loop uses and lets it go. Holds nest (a ``with`` inside a granted request
    takes nothing more); the file is unlocked when the last one ends. One thread (the loop)
    uses a lock; the waiter is its own.
    """

    def __init__(self, path: str | None):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600) if path else None
        self._waiter = _Waiter(self._fd) if self._fd is not None else None
        self._holds = 0  # ``with`` blocks and the loop's request that hold (or await) the lock
        self._held = False  # this open file holds the flock
        self._asked = False  # the loop's request waits for the waiter

    @property
    def shared(self) -> bool:
        """Other nodes may wait for this lock: there is a file."""
        return self._fd is not None

    @property
    def pending(self) -> bool:
        """A request waits for the lock: ``fileno()`` turns readable when it is granted."""
        return self._asked

    def fileno(self) -> int | None:
        """A file descriptor readable once a pending request is granted (None: no lock)."""
        return self._waiter.fileno() if self._waiter is not None else None

    def request(self) -> bool:
        """Hold the lock without blocking: True when held now (free at once, or granted since
        an earlier call), and ``release()`` is then due. False while another process holds
        it: the waiter waits for it; call again once ``fileno()`` is readable."""
        if self._fd is None:
            return True
        if self._asked:
            if not self._waiter.take():
                return False
            self._asked, self._held = False, True
            return True
        self._holds += 1
        if self._held or _try_lock(self._fd):
            self._held = True
            return True
        self._asked = True
        self._waiter.ask()
        return False

    def acquire(self) -> None:
        """Hold the lock, blocking until it is free (or until a pending request is granted)."""
        if self._fd is None:
            return
        self._holds += 1
        if self._held:
            return
        if self._asked:
            self._waiter.granted.wait()  # the request keeps its grant: ``request()`` still takes it
        else:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._held = True

    def release(self) -> None:
        """End one hold; the file is unlocked with the last."""
        if self._fd is None:
            return
        self._holds -= 1
        if self._holds == 0 and self._held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = False

    def note_cpu(self, cpu: int) -> None:
        """Record in the file, while holding the lock, the CPU this process's pass ran on."""
        if self._fd is not None and cpu >= 0:
            os.pwrite(self._fd, cpu.to_bytes(4, "little") + os.getpid().to_bytes(4, "little"), 0)

    def handed_cpu(self) -> int:
        """The CPU the last pass under this lock ran on, where another process ran it (a turn
        handed over, ``note_cpu``); -1 where none was noted or the last was this process's."""
        if self._fd is None:
            return -1
        data = os.pread(self._fd, 8, 0)
        if len(data) != 8 or int.from_bytes(data[4:], "little") == os.getpid():
            return -1
        return int.from_bytes(data[:4], "little")

    def __enter__(self) -> "ComputeLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def close(self) -> None:
        """Close the file (which unlocks it). A waiter still blocked in ``flock`` closes it
        once that returns: a thread cannot be woken from ``flock``."""
        if self._fd is not None:
            self._waiter.close()
            self._fd = None


def current_cpu() -> int:
    """The CPU the calling thread runs on now (-1 where the C library cannot say)."""
    global _sched_getcpu
    if _sched_getcpu is None:
        try:
            _sched_getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
        except (OSError, AttributeError):
            _sched_getcpu = lambda: -1  # noqa: E731
    return _sched_getcpu()


_sched_getcpu = None


@contextlib.contextmanager
def on_cpu(cpu: int):
    """The calling thread on ``cpu`` alone within (where this process may run there), on the
    CPUs it had before after."""
    allowed = os.sched_getaffinity(0) if cpu >= 0 and hasattr(os, "sched_setaffinity") else ()
    if cpu not in allowed or len(allowed) == 1:
        yield
        return
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class _Waiter:
    """A thread that blocks in ``flock`` for the loop and then writes a byte to a pipe the
    loop polls. It owns the lock's fd and the pipe and closes them (``close``), at once or,
    when blocked in ``flock``, as soon as that returns. Started at the first wait."""

    def __init__(self, fd: int):
        self.fd = fd
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.granted = threading.Event()  # the waiter holds the lock for the loop
        self._asked = threading.Event()
        self._mutex = threading.Lock()  # guards the two flags below, and the wake-up byte with ``granted``
        self._locking = False  # the thread is in flock: it closes the fds
        self._closed = False
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._read

    def ask(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="compute-lock-waiter", daemon=True)
            self._thread.start()
        self._asked.set()

    def take(self) -> bool:
        """Whether the lock was granted; if so, the wake-up byte is read and the grant used.
        Once ``fileno()`` is readable this is true: the byte and the grant come together."""
        with self._mutex:
            if not self.granted.is_set():
                return False
            self.granted.clear()
            os.read(self._read, 1)
            return True

    def _serve(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            with self._mutex:
                if self._closed:
                    return
                self._locking = True
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            with self._mutex:
                self._locking = False
                if self._closed:
                    self._close_fds()
                    return
                os.write(self._write, b"\0")
                self.granted.set()

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            if not self._locking:
                self._close_fds()
        self._asked.set()  # an idle thread ends

    def _close_fds(self) -> None:
        for fd in (self.fd, self._read, self._write):
            os.close(fd)


class Members:
    """The nodes that use one compute lock file now, this one among them, so that each can take
    its share of the machine's cores. Each holds an exclusive ``flock`` on a file of its own in
    ``LOCKFILE.nodes/`` while it lives; the kernel lets the lock go when a process dies, so a
    file nobody holds is a dead node's and is removed. A file joins under a hidden name and is
    renamed once locked, so it is never counted, or removed, before it is held. No path (or a
    directory that cannot be made): this node alone."""

    def __init__(self, lock_path: str | None):
        self.dir = lock_path and lock_path + ".nodes"
        self._fd: int | None = None
        self._path = ""
        self._counted, self._at = 1, -RECOUNT_S
        if self.dir:
            try:
                self._join()
            except OSError as exc:
                log.warning("cannot count the nodes sharing %s (%s): counting this node alone", lock_path, exc)
                self.dir = None

    def _join(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        hidden = os.path.join(self.dir, "." + name)
        self._fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._path = os.path.join(self.dir, name)
        os.rename(hidden, self._path)

    def count(self) -> int:
        """How many nodes hold a file here now (at least 1: this one), looked at once a second."""
        now = time.monotonic()
        if self.dir and now - self._at >= RECOUNT_S:
            self._at = now
            try:
                self._counted = max(1, self._look())
            except OSError as exc:  # the directory went (a cleaned /tmp): the last count stands
                log.warning("cannot count the nodes in %s: %s", self.dir, exc)
        return self._counted

    def _look(self) -> int:
        alive = 0
        for entry in os.scandir(self.dir):
            if entry.name.startswith("."):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                alive += 1
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # nobody holds it: its node died
            finally:
                os.close(fd)
        return alive

    def close(self) -> None:
        """Leave: this node is no longer counted."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            os.close(self._fd)
            self._fd = None
