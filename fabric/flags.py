"""What every ``meshnet`` command shares: the flag value types, one error line, the help
format, the version, and the check that a tracker's port is open at all.

Every refusal reads ``meshnet: error: MESSAGE`` on one line of stderr: a usage error (a
flag's value cannot work) exits with status 2, a runtime failure with status 1. A value
that is malformed is refused while the command line is parsed, by the flag's ``type``
here, so a config file's value goes through the same check (``fabric.config``).
"""
from __future__ import annotations

import argparse
import configparser
import math
import re
import socket
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

ENDPOINT_FORM = "tcp://HOST:PORT"
# * (every interface), [IPv6], or a host name, IPv4 address or interface name
_HOST = re.compile(r"\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+")


class CommandError(Exception):
    """A refusal the command line prints as one line; ``status`` 2: usage, 1: runtime."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def error_line(message: str) -> None:
    print(f"meshnet: error: {message}", file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, pointing at the command's --help."""

    def error(self, message: str):
        error_line(f"{message} (see `{self.prog} --help`)")
        self.exit(2)


class HelpFormatter(argparse.HelpFormatter):
    """Shows every flag's default, and says so when a config file set it
    (``fabric.config.apply`` records that in ``action.config_source``). A command's copy of
    meshnet's own flag (``action.same_as``) shows that flag's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        origin = getattr(action, "same_as", action)
        value = "%(default)s" if origin is action else str(origin.default).replace("%", "%%")
        source = getattr(origin, "config_source", None)
        if source:
            return f"{text} (set in {source}{'' if '%(default)' in text else ': ' + value})"
        if origin.dest == "config":
            return f"{text} (in use: {value})" if origin.default else text
        if ("default" in text or not action.option_strings or action.nargs == 0
                or origin.default in (None, argparse.SUPPRESS)):
            return text  # said in words, or nothing to show (a switch is off unless given)
        return f"{text} (default: {value})"


def version() -> str:
    """The installed distribution's version, else the one setup.cfg names."""
    try:
        return metadata.version("meshnet")
    except metadata.PackageNotFoundError:
        cfg = configparser.ConfigParser()
        cfg.read(Path(__file__).resolve().parent.parent / "setup.cfg")
        return cfg.get("metadata", "version", fallback="unknown")


def endpoint(text: str) -> str:
    """``tcp://HOST:PORT`` for ``tcp://HOST:PORT`` or plain ``HOST:PORT``; ``ipc://PATH`` as given.
    PORT may be 0 or * (a port chosen at bind time)."""
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    host, colon, port = text.removeprefix("tcp://").rpartition(":")
    if colon and _HOST.fullmatch(host) and (port == "*" or (port.isdigit() and int(port) < 65536)):
        return f"tcp://{host}:{port}"
    raise argparse.ArgumentTypeError(f"{text!r} is not an endpoint: expected {ENDPOINT_FORM} (or HOST:PORT), "
                                     "such as tcp://127.0.0.1:5555")


def refuse_absent_tracker(tracker: str, before: str = "", status: int = 1) -> None:
    """CommandError (``status``, its line after ``before``) at once where no tracker can answer
    at ``tracker``: a tcp:// port whose connection is refused. A client would wait its whole
    timeout (5-10 s) to say the tracker did not answer; a host that drops packets, or a slow
    one, is still left to that wait."""
    if not tracker.startswith("tcp://"):
        return
    host, _, number = tracker.removeprefix("tcp://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(number)), timeout=1.0).close()
    except ConnectionRefusedError:
        raise CommandError(f"{before}tracker_unavailable: tracker at {tracker} did not answer: nothing listens on "
                           "that port (is it running? `meshnet tracker` or `meshnet up` starts one)", status) from None
    except (OSError, ValueError):
        return


def origins(text: str) -> frozenset[str]:
    """``--cors-origins``: comma-separated web origins (``scheme://host[:port]``, as a browser
    sends them), or ``*`` for any."""
    found = frozenset(o.strip().rstrip("/").lower() for o in text.split(",") if o.strip())
    for origin in found - {"*"}:
        try:
            parts = urlsplit(origin)
            parts.port  # noqa: B018 -- raises on a port out of range
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
            raise argparse.ArgumentTypeError(f"{origin!r} is not a web origin: expected scheme://host[:port] "
                                             "(such as http://192.168.1.20:3000), or * for any")
    if not found:
        raise argparse.ArgumentTypeError("name at least one origin, or * for any")
    return found


def port(text: str) -> int:
    """A TCP port, 0-65535."""
    if text.strip().isdigit() and int(text) < 65536:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: expected a number from 0 to 65535")


def seconds(text: str) -> float:
    """A time above zero, in seconds."""
    value = _float(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0, such as 1.5")
    return value


def non_negative(text: str) -> float:
    """A number of 0 or more (0 usually meaning "off" or "automatic")."""
    value = _float(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of 0 or more")
    return value


def share(text: str) -> float:
    """A fraction from 0 to 1."""
    value = _float(text)
    if value is None or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share from 0 to 1, such as 0.05")
    return value


def count(text: str) -> int:
    """A whole number of 0 or more (0 usually meaning "automatic")."""
    if text.strip().isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 0 or more")


def positive_count(text: str) -> int:
    """A whole number of 1 or more."""
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
