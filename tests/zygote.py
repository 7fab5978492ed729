"""A process that has imported what a node imports, forking test nodes on request.

A node process spends 5-10 s of CPU importing torch and transformers before it does anything a
test looks at, and the suite starts about a hundred of them on a 2-core machine. This server
imports those modules once; ``ProcessCluster`` asks it for each plain ``meshnet node``, and it
forks a child that runs ``meshnet`` with that node's argv, environment, directory and
stdout/stderr, exactly as ``python -m fabric.cli`` would. Each child is a real process of its
own: it is signalled, killed with SIGKILL and reaped by its pid, and its exit status comes
back as a ``subprocess.Popen``'s would (``Forked``).

What a fork cannot give a child is anything read once when a library loads: OpenMP's and
oneDNN's environment, and the constants huggingface_hub computes from ``XDG_CACHE_HOME`` or
``HOME``. So ``Zygote.spawn`` forks only where those are the server's own (``same_start``) and
the command is a node started through ``fabric.cli``, directly or by a test script of
``SCRIPTS`` that patches it first (a lying node); everything else, such as a node under
``python -X importtime`` or with another home, gets a fresh interpreter. Set
``MESHNET_TEST_FORK=0`` to give every node one.

Run as ``python -m tests.zygote SOCKET``: it prints ``ready`` once it listens.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# variables nothing reads when it loads: they may differ between the server and a child
READ_LATER = {"XDG_DATA_HOME", "XDG_RUNTIME_DIR", "PYTEST_CURRENT_TEST"}
# the model families the tests run: their transformers modules are imported once, here
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3", "phi3", "mixtral")
HEADER = struct.Struct("!I")
# test scripts that patch a node, then run fabric.cli's main: forked as ``python SCRIPT ARGV`` would run
SCRIPTS = (ROOT / "tests" / "liar_node.py", ROOT / "tests" / "corrupt_share_node.py")


def same_start(env: dict, base: dict) -> bool:
    """Whether a process started with ``env`` would load its libraries as one with ``base``."""
    strip = lambda e: {k: v for k, v in e.items() if k not in READ_LATER}  # noqa: E731
    return strip(env) == strip(base)


# ---- the server -------------------------------------------------------------------------------

def preload() -> None:
    """Import what a node imports, after setting what a node sets before torch loads
    (``fabric.cli.node_command.prepare_process``, with the float32 kernels' OpenMP spin) and
    after torch loads (``leave_out_compiler_and_collectives``)."""
    from fabric.cli.torch_env import (grouped_kv_attention, leave_out_compiler_and_collectives,
                                      leave_out_unused_packages, omp_workers_nap)

    omp_workers_nap()
    grouped_kv_attention()
    leave_out_unused_packages()
    import importlib

    import torch  # noqa: F401

    leave_out_compiler_and_collectives()
    import transformers  # noqa: F401

    import fabric.cli.node_command  # noqa: F401
    import fabric.compute.models  # noqa: F401
    import fabric.node.node  # noqa: F401
    for family in FAMILIES:
        try:
            importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            pass
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401


def serve(path: str) -> None:
    """Listen on the Unix socket ``path``; fork a child for each request; tell each requester
    its child's pid, then its exit status. Runs until killed."""
    os.close(os.pidfd_open(os.getpid()))  # Linux 5.3 and later: else this dies here and the tests start fresh nodes
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, requester)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _fork(conn, listener, selector, children)
                if pid:
                    pidfd = os.pidfd_open(pid)
                    children[pidfd] = (pid, conn)
                    selector.register(pidfd, selectors.EVENT_READ)
                    _tell(conn, f"pid {pid}")
            else:
                pid, conn = children.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                _tell(conn, f"exit {os.waitstatus_to_exitcode(status)}")
                conn.close()


def _tell(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:  # the requester has gone: its child runs on, and is reaped all the same
        pass


def _fork(conn, listener, selector, children) -> int:
    """Read one request and fork its child; returns the pid (0 where the request was bad)."""
    try:
        header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
        body = _read(conn, HEADER.unpack(header)[0])
        request = json.loads(body)
    except (OSError, ValueError, struct.error):
        conn.close()
        return 0
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    # the child: nothing of the server's may stay open, or be closed later under a reused number
    selector.close()
    listener.close()
    conn.close()
    for pidfd, (_, other) in children.items():
        os.close(pidfd)
        other.close()
    try:
        _run(request, fds)
    finally:
        os._exit(1)  # never back into the server's loop


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the requester hung up")
        data += chunk
    return data


def _run(request: dict, fds: list[int]) -> None:
    """The child: become ``python -m fabric.cli ARGV`` (or ``python SCRIPT ARGV``) and never return."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no child outlives the server
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    code = 1
    try:
        code = _main(request.get("script"), request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, status 1
        traceback.print_exc()
    _exit(code)


def _main(script: str | None, argv: list[str]) -> int:
    """``fabric.cli``'s main on ``argv``; or the test script ``script`` run as ``__main__`` with
    its own directory first on the path, as ``python SCRIPT ARGV`` runs it (tests/liar_node.py:
    a node with a patch, then ``fabric.cli``'s main)."""
    if script is None:
        sys.argv = [str(ROOT / "fabric" / "cli" / "__main__.py"), *argv]
        from fabric.cli import main

        return main(argv)
    import runpy

    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
    return 0


def _exit(code: int) -> None:
    """What the interpreter does on its way out: join threads, run atexit, flush; then exit."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:  # died of a signal, as an uncaught KeyboardInterrupt does
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code or 0)


# ---- the test's side ----------------------------------------------------------------------------

class Forked:
    """A forked child as ``subprocess.Popen`` shows a process: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill`` and ``returncode``."""

    def __init__(self, conn: socket.socket, args: list[str]):
        self.args = args
        self.stdin = self.stdout = self.stderr = None
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        line = self._line(120.0)
        if not line or not line.startswith("pid "):
            raise OSError(f"the test zygote started no process for {args}: {line!r}")
        self.pid = int(line.split()[1])

    def _line(self, timeout: float | None) -> str | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(256)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise OSError("the test zygote hung up")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid the server may have reaped and the system reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The server for this test session, started at its first use."""

    def __init__(self):
        self.path = None
        self.env: dict | None = None
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def spawn(self, argv: list[str], env: dict, cwd: Path, stdout: int, stderr: int,
              script: Path | None = None) -> Forked | None:
        """Fork ``meshnet ARGV`` (a ``node`` command), or ``python SCRIPT ARGV`` for a test script
        that patches a node and then runs ``fabric.cli`` (tests/liar_node.py), with the files
        ``stdout``/``stderr``; None where a fork would not start as a fresh interpreter would
        (see the module's docstring)."""
        if os.environ.get("MESHNET_TEST_FORK", "1") == "0":
            return None
        with self.lock:
            if not self._started(env):
                return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
        except OSError:  # the server died: start fresh
            conn.close()
            return None
        request = {"argv": argv, "env": env, "cwd": str(cwd), "script": str(script) if script else None}
        body = json.dumps(request).encode()
        with open(os.devnull, "rb") as stdin:
            socket.send_fds(conn, [HEADER.pack(len(body))], [stdin.fileno(), stdout, stderr])
        conn.sendall(body)
        return Forked(conn, [sys.executable, *([str(script)] if script else ["-m", "fabric.cli"]), *argv])

    def _started(self, env: dict) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None and same_start(env, self.env)
        import tempfile

        self.path = os.path.join(tempfile.mkdtemp(prefix="meshnet-zygote-"), "sock")
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path], env=env, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None)
        ready = self.proc.stdout.readline()
        if ready.strip() != b"ready":  # this machine cannot: every node starts fresh, as without it
            self.proc.kill()
            self.proc.wait()
            return False
        atexit.register(self.close)
        return True

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.path:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


ZYGOTE = Zygote()


if __name__ == "__main__":
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the test session
    preload()
    serve(sys.argv[1])
