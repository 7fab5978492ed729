"""Helpers every test and bench script shares: one ``free_port``, one ``wait_for``, one fake clock."""
from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

# `python -c CLI_REPORTING_TORCH ARGS` runs `meshnet ARGS` (as `python -m fabric.cli` does), then
# prints whether torch was imported: "torch: False" for a command that answers without it
CLI_REPORTING_TORCH = ("import runpy, sys\ntry:\n    runpy.run_module('fabric.cli', run_name='__main__', alter_sys=True)\n"
                       "finally:\n    print('torch:', 'torch' in sys.modules)")


# `python -c CLI_AT_A_TERMINAL ARGS` runs `meshnet ARGS` with SIGINT's default, as a shell gives its
# foreground job: a suite started in the background (`cmd &` in a script) runs with SIGINT ignored,
# an ignored SIGINT stays ignored across exec, and a Ctrl-C sent to `meshnet` would do nothing
CLI_AT_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "os.execv(sys.executable, [sys.executable, '-m', 'fabric.cli', *sys.argv[1:]])")


def cli(report_torch: bool = False, interruptible: bool = False) -> list[str]:
    """The command that runs this checkout's `meshnet`: ``python -m fabric.cli``; with
    ``report_torch`` ``CLI_REPORTING_TORCH`` (stdout then ends with whether torch was imported);
    with ``interruptible`` ``CLI_AT_A_TERMINAL`` (a SIGINT sent to it is a Ctrl-C)."""
    if report_torch:
        return [sys.executable, "-c", CLI_REPORTING_TORCH]
    return [sys.executable, "-c", CLI_AT_A_TERMINAL] if interruptible else [sys.executable, "-m", "fabric.cli"]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now), and that this process has not
    handed out before: a tracker's port picked first may not be bound yet when a node's is
    picked (a tracker starts an interpreter; a node is forked ready), and the OS would offer it
    again."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def port_is_free(port: int) -> bool:
    """Whether 127.0.0.1:``port`` can be bound now (as ZeroMQ binds: with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout``; returns its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def at_once(task: Callable[[int], T], count: int, timeout: float = 120.0) -> dict[int, T]:
    """``task(i)`` for each i below ``count``, each in a thread of its own, all released
    together; what each returned, by i (a task that raised or did not end is missing)."""
    results: dict[int, T] = {}
    together = threading.Barrier(count)

    def run(i: int) -> None:
        together.wait(30)
        results[i] = task(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


class FakeClock:
    """A clock a test moves by hand (``clock.now += 5``): timeouts without sleeping."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def on_threads(n: int, fn, *args):
    """``fn(*args)`` with torch (and the kernels it drives) on ``n`` threads, as a node runs a
    one-token pass (fabric.node.hops.on_threads)."""
    from fabric.node.hops import on_threads as threads

    with threads(n):
        return fn(*args)
