"""Ports a command is about to listen on: refused up front when taken, and a bind that fails
later said in one line naming the flag to change."""
from __future__ import annotations

import contextlib
import errno
import socket

from ..flags import CommandError


def refuse_ports_in_use(endpoints: dict[str, str], who: str) -> None:
    """CommandError when a port these endpoints (by role, "the tracker, --bind") name is taken."""
    busy = _ports_in_use(endpoints)
    if busy:
        flags = [role.rpartition(", ")[2] for role in endpoints]
        named = f"other ports with {', '.join(flags[:-1])} and {flags[-1]}" if len(flags) > 1 \
            else f"another port with {flags[0]}"
        raise CommandError(f"already in use on this machine: {'; '.join(busy)}. Is another {who} running? "
                           f"Stop it, or choose {named}")


def _ports_in_use(endpoints: dict[str, str]) -> list[str]:
    """Which of these TCP endpoints ("tcp://host:port", by role) something already listens
    on: ``up`` would start every other process and then lose the one that cannot bind (and
    its nodes would join the other cluster's tracker meanwhile)."""
    busy = []
    for role, address in endpoints.items():
        host, _, number = address.removeprefix("tcp://").rpartition(":")
        if not address.startswith("tcp://") or not number.isdigit() or int(number) == 0:
            continue  # ipc://, or a port chosen at bind time: nothing to check
        host = "" if host in ("*", "0.0.0.0") else host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and the web server bind
            try:
                probe.bind((host, int(number)))
            except OSError as exc:  # any other failure (an address not on this machine) is the process's to report
                if exc.errno == errno.EADDRINUSE:
                    busy.append(f"port {number} ({role})")
    return busy


BIND_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


@contextlib.contextmanager
def listening(flags: str, where: str = ""):
    """A socket that cannot bind (taken since the ports were checked, or an address not on
    this machine) as one line naming the address (ZeroMQ's errors name it themselves) and the
    ``flags`` to change; status 1: found while running."""
    import zmq

    try:
        yield
    except (OSError, zmq.ZMQError) as exc:
        if exc.errno not in BIND_ERRORS:
            raise
        raise CommandError(f"cannot listen{where and f' on {where}'}: {exc.strerror}; choose another {flags}",
                           1) from None
