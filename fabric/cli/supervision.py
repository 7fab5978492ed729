"""Starting and stopping a group of processes: ``meshnet up``'s cluster, and the clusters the
tests and bench/ start. One way to stop them, so that none is left running."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable

from ..flags import error_line

# (stop, procs) -> None: returns once the group serves (or stop is set, or one died)
Announce = Callable[[threading.Event, list[subprocess.Popen]], None]


def supervise(commands: list[list[str]], announce: Announce | None = None) -> int:
    """Run every command; stop them all on Ctrl-C or SIGTERM (status 0) or when any one dies
    (status 1, its role said in one line). ``announce`` tells the user once they serve."""
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell may start us with it ignored
        signal.signal(sig, lambda *_: stop.set())
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd))
        if announce:
            announce(stop, procs)
        while not stop.is_set():
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                role = next((a for a in dead[0].args if a in ("tracker", "node", "webui")), dead[0].args[-1])
                error_line(f"the {role} process exited with status {dead[0].returncode}; stopping the cluster")
                return 1
            stop.wait(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop_processes(procs)


def stop_processes(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGINT every live process (last started first), wait up to ``grace`` s, then kill."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
