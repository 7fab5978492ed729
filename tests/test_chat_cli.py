"""`meshnet chat` as a user types it, in a subprocess against a real tracker and nodes on
loopback: one prompt (an argument, or piped on stdin), and the conversation at a ``>>> ``
prompt driven through a pseudo-terminal, where Ctrl-C and Ctrl-D are typed as on a keyboard."""
from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric import config
from fabric.cli import build_parser
from tests.cluster import ROOT, wait_sessions_zero
from tests.support import wait_for

QUESTION = "hello world, how are you today?"  # a long greedy reply with no end-of-sequence (tests/test_processes.py)
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")  # what a line editor may send around the prompt


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """No config file; a plain terminal for the line editor."""
    base = {k: v for k, v in os.environ.items() if k != config.ENV_VAR}
    return {**base, "XDG_CONFIG_HOME": str(tmp_path / "config"), "TERM": "dumb", "INPUTRC": "/dev/null",
            "PYTHONIOENCODING": "utf-8"}


@pytest.fixture
def split(thread_cluster, tiny_models, tmp_path):
    """A tiny llama split over two nodes that take turns at one compute lock (the ``Gate``);
    yields (cluster, model id, node endpoints, gate)."""
    model = tiny_models("llama")
    lock = str(tmp_path / "compute.lock")
    nodes = [thread_cluster.add_node(model, 0, 2, 6, "head", compute_lock=lock),
             thread_cluster.add_node(model, 3, 5, 6, "tail", compute_lock=lock)]
    thread_cluster.wait_routable(model.name, 2)
    gate = Gate(lock)
    yield thread_cluster, model.name, [n.endpoint for n in nodes], gate
    gate.close()


class Gate:
    """The nodes' compute lock, held from the test: while it is shut no node computes a step."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def shut(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # waits for the step a node is computing

    def open(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


def chat_args(cluster, model: str, *flags: str) -> list[str]:
    return ["chat", "--tracker", cluster.endpoint, "--model", model, *flags]


def meshnet(args: list[str], env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fabric.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env, stdin=subprocess.DEVNULL if stdin is None else None)


def direct(cluster, model: str, messages: list[dict], **kw) -> str:
    """The reply ``Client.generate`` streams for ``messages``, as text."""
    with cluster.client() as client:
        return "".join(e.text for e in client.generate(model, messages=messages, **kw) if e.event == "token")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# ----------------------------------------------------------------------------- one prompt


def test_a_piped_prompt_is_the_same_chat_as_an_argument(split, env):
    cluster, model, _, _ = split
    args = chat_args(cluster, model, "--max-tokens", "16")
    typed = meshnet([*args, "hello", "world"], env)
    piped = meshnet(args, env, stdin="hello world\n")
    assert typed.returncode == piped.returncode == 0, typed.stderr + piped.stderr
    assert typed.stdout == piped.stdout == direct(cluster, model, [user("hello world")], max_tokens=16) + "\n"
    both = meshnet([*args, "how are you"], env, stdin="hello world\n")  # stdin first, as ollama run
    assert both.stdout == direct(cluster, model, [user("hello world how are you")], max_tokens=16) + "\n"
    assert not (typed.stderr + piped.stderr + both.stderr)


def test_system_top_k_seed_and_stop_reach_the_request(split, env):
    cluster, model, _, _ = split
    sampled = dict(max_tokens=24, temperature=2.0, top_k=4, seed=7)
    messages = [{"role": "system", "content": "be brief"}, user(QUESTION)]
    full = direct(cluster, model, messages, **sampled)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    flags = ["--system", "be brief", "--max-tokens", "24", "--temperature", "2", "--top-k", "4", "--seed", "7"]
    out = meshnet([*chat_args(cluster, model, *flags), QUESTION], env)
    assert (out.returncode, out.stdout) == (0, full + "\n"), out.stderr
    out = meshnet([*chat_args(cluster, model, *flags, "--stop", "never there", "--stop", stop), QUESTION], env)
    assert out.stdout == full[:full.find(stop)] + "\n"


@pytest.mark.parametrize("flags, words", [
    (["--temperature", "500"], "temperature must be in [0, 2]"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--stop", ""], "stop takes at most 4 non-empty strings"),
    (["--top-k", "-1"], "top_k must be in [0, 2**20]"),
    (["--max-tokens", "0"], "max_tokens must be in [1, 2**20]"),
    (["--seed", "-1"], "seed must be in [0, 2**63)"),
    (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
])
def test_a_bad_flag_is_one_line_before_any_request(env, flags, words):
    out = meshnet(["chat", "--tracker", "tcp://127.0.0.1:1", *flags, "hi"], env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("meshnet: error: ") and words in out.stderr and out.stderr.count("\n") == 1


def test_no_prompt_and_an_empty_stdin_is_one_line(env):
    out = meshnet(["chat", "--tracker", "tcp://127.0.0.1:1"], env, stdin="")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no prompt" in out.stderr


def test_every_chat_flag_has_help_that_shows_its_default():
    chat = next(a for a in build_parser()._actions if a.dest == "command").choices["chat"]
    for action in chat._actions:
        if action.option_strings and action.dest != "help":
            shown = chat._get_formatter()._expand_help(action)
            assert "default" in shown, f"meshnet chat {action.option_strings[0]}: {shown}"


# ----------------------------------------------------------------------------- a conversation


class Terminal:
    """``meshnet`` on a pseudo-terminal that is its controlling terminal, so that a typed ^C
    is the SIGINT a keyboard sends; stderr goes to a file."""

    # the child makes the terminal its own before it becomes meshnet (no fork in this threaded process), and
    # takes SIGINT's default as a shell gives its foreground job: a suite started in the background (`cmd &`
    # in a script) runs with SIGINT ignored, and an ignored SIGINT stays ignored across exec
    LAUNCH = ("import fcntl, os, signal, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
              "signal.signal(signal.SIGINT, signal.SIG_DFL); "
              "os.execv(sys.executable, [sys.executable, '-m', 'fabric.cli', *sys.argv[1:]])")

    def __init__(self, args: list[str], env: dict, stderr: Path):
        self.master, slave = pty.openpty()
        self.stderr_path = stderr
        with open(stderr, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", self.LAUNCH, *args], stdin=slave, stdout=slave,
                                         stderr=err, cwd=ROOT, env=env)
        os.close(slave)
        self.buffer = b""

    def read_until(self, marker: bytes, timeout: float = 60) -> bytes:
        """Everything up to and including ``marker``, consumed."""
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {self.buffer[-400:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the other side closed
                    chunk = b""
                assert chunk, f"meshnet exited before {marker!r}: {self.buffer[-400:]!r}"
                self.buffer += chunk
        at = self.buffer.index(marker) + len(marker)
        seen, self.buffer = self.buffer[:at], self.buffer[at:]
        return seen

    def read_some(self, timeout: float) -> bytes:
        """What arrives within ``timeout`` seconds, left unconsumed."""
        if select.select([self.master], [], [], timeout)[0]:
            with contextlib.suppress(OSError):
                self.buffer += os.read(self.master, 4096)
        return self.buffer

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait_reading(self, timeout: float = 30) -> None:
        """Until meshnet's main thread blocks waiting for a key (x86-64: poll, select, pselect6 or
        ppoll). A ^C typed after readline wrote its prompt but before it called select() is seen
        only when select() returns, which it never does without another key: CPython's readline
        loop. A person types ^C again; a test waits for the read instead."""
        syscall = Path(f"/proc/{self.proc.pid}/syscall")
        assert wait_for(lambda: syscall.read_text().split()[0] in {"7", "23", "270", "271"}, timeout, 0.02), \
            syscall.read_text()

    def say(self, text: str) -> bytes:
        """Type a line at the prompt; what the terminal showed until the next prompt."""
        self.type(text + "\r")
        return ANSI.sub(b"", self.read_until(b">>> "))

    def exit_status(self) -> int:
        status = self.proc.wait(30)
        os.close(self.master)
        return status

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()


def shown(reply: str) -> bytes:
    """``reply`` as the terminal shows it (its line discipline turns \\n into \\r\\n)."""
    return reply.encode().replace(b"\n", b"\r\n")


def test_a_conversation_keeps_its_turns_and_bye_exits(split, env, tmp_path):
    cluster, model, _, _ = split
    term = Terminal(chat_args(cluster, model, "--max-tokens", "12"), env, tmp_path / "stderr")
    term.read_until(b">>> ")
    first = direct(cluster, model, [user("hello world")], max_tokens=12)
    assert shown(first) + b"\r\n\r\n" in term.say("hello world")
    second = direct(cluster, model, [user("hello world"), {"role": "assistant", "content": first},
                                     user("how are you")], max_tokens=12)
    assert second != direct(cluster, model, [user("how are you")], max_tokens=12), "pick turns that tell"
    assert shown(second) in term.say("how are you")
    assert b"/bye" in term.say("/?")
    term.type("/bye\r")
    assert term.exit_status() == 0
    assert "Traceback" not in term.stderr and term.stderr == ""


def test_ctrl_c_stops_a_reply_on_every_node_and_ctrl_d_exits(split, env, tmp_path):
    cluster, model, nodes, gate = split
    term = Terminal(chat_args(cluster, model, "--max-tokens", "400"), env, tmp_path / "stderr")
    term.read_until(b">>> ")
    full = direct(cluster, model, [user(QUESTION)], max_tokens=400)
    gate.shut()
    term.type(QUESTION + "\r")
    term.read_until(QUESTION.encode() + b"\r\n")  # the echo; the reply streams after it
    deadline = time.monotonic() + 30
    while not term.read_some(0.2).strip() and time.monotonic() < deadline:
        gate.open()  # a few steps at a time, until the reply shows
        time.sleep(0.02)
        gate.shut()
    assert term.buffer.strip(), "no reply came"
    term.type("\x03")  # the nodes are stalled mid-reply: only Ctrl-C can end it now
    assert shown(full) not in ANSI.sub(b"", term.read_until(b">>> "))
    gate.open()
    wait_sessions_zero(nodes, timeout=60.0)  # raises if a hop still holds the session

    def cancelled() -> bool:
        with cluster.client() as client:
            return any(e.get("finish_reason") == "cancelled" for e in client.status()["events"])
    assert wait_for(cancelled, 60.0)  # the sessions ended by the cancel, not by running out
    later = direct(cluster, model, [user("hello world")], max_tokens=400)
    assert shown(later) + b"\r\n\r\n" in term.say("hello world")  # the stopped turn is forgotten
    term.type("\x04")
    assert term.exit_status() == 0
    assert "Traceback" not in term.stderr and term.stderr == ""


def test_ctrl_c_at_the_prompt_exits_cleanly(split, env, tmp_path):
    cluster, model, _, _ = split
    term = Terminal(chat_args(cluster, model), env, tmp_path / "stderr")
    term.read_until(b">>> ")
    term.wait_reading()
    term.type("\x03")
    assert term.exit_status() == 0
    assert "Traceback" not in term.stderr and term.stderr == ""
