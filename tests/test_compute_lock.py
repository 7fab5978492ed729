"""Nodes on one host share the compute by default: every node of a user on a device locks the
same file, so two `meshnet node` processes started by hand take turns as `meshnet up`'s do."""
from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from fabric.cli.node_command import _compute_lock
from fabric.compute.compute_lock import ComputeLock, LockDirError, default_path, private_dir
from fabric.compute.models import resolve
from fabric.compute.tensors import to_wire
from fabric.flags import CommandError
from fabric.node import Node, NodeConfig
from fabric.wire import protocol as p
from fabric.wire.shard import Shard
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
from tests.cluster import ping
from tests.support import wait_for
from tests.tiny_models import reference_greedy

ROOT = Path(__file__).resolve().parent.parent


def test_the_default_lock_is_one_file_per_device_in_the_users_runtime_dir(tmp_path):
    run = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert default_path("cpu", run) == tmp_path / "meshnet" / "compute-cpu.lock"
    assert default_path("cpu", {}, uid=1234) == Path("/tmp/meshnet-1234/compute-cpu.lock")
    assert default_path("cpu", {"XDG_RUNTIME_DIR": ""}, uid=7) == Path("/tmp/meshnet-7/compute-cpu.lock")
    assert default_path("cuda", run) == default_path("cuda:0", run) == tmp_path / "meshnet" / "compute-cuda0.lock"
    assert default_path("cuda:1", run) != default_path("cuda:0", run)


def test_the_default_lock_directory_is_private(tmp_path):
    path = default_path("cpu", {"XDG_RUNTIME_DIR": str(tmp_path)})
    private_dir(path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.parent.chmod(0o777)  # anyone could swap or hold the lock there
    with pytest.raises(LockDirError, match="only this user"):
        private_dir(path)


def test_compute_lock_flag_default_file_and_none(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert _compute_lock(None, "cpu") == str(tmp_path / "meshnet" / "compute-cpu.lock")
    assert (tmp_path / "meshnet").is_dir()
    assert _compute_lock("/some/file.lock", "cpu") == "/some/file.lock"
    assert _compute_lock("none", "cpu") is None
    (tmp_path / "meshnet").chmod(0o775)
    with pytest.raises(CommandError, match="--compute-lock none"):
        _compute_lock(None, "cpu")


def test_node_help_shows_the_default_lock(tmp_path):
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    out = subprocess.run([sys.executable, "-m", "fabric.cli", "node", "--help"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{tmp_path}/meshnet/compute-DEVICE.lock" in out.stdout


def _open_files(pid: int) -> set[str]:
    """The files process ``pid`` holds open (a descriptor it closes while they are read is left out)."""
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed between the listing and the read: the node's sockets come and go
            continue
        if not target.startswith(("socket:", "pipe:", "anon")):
            names.add(target)
    return names


def test_two_standalone_nodes_take_turns_at_the_default_lock(process_cluster, tiny_models):
    """Two `meshnet node` processes with no --compute-lock on one host (one runtime
    directory) open the same default file, and while another process holds it exclusively
    neither computes a step, yet both answer PINGs: the reply comes only once it is let go,
    and equals the reference."""
    model = tiny_models("llama")
    expected = reference_greedy(model, prompt_ids(model), 12)
    process_cluster.split(model)
    lock = default_path("cpu", {"XDG_RUNTIME_DIR": str(process_cluster.runtime_dir)})
    for name in ("a", "b"):
        assert str(lock) in _open_files(process_cluster.procs[name].pid), name
    gate = ComputeLock(str(lock))
    got: list[int] = []
    with process_cluster.client() as client:
        reader = threading.Thread(target=lambda: got.extend(
            t for e in client.generate(model.name, messages=MESSAGES, max_tokens=12) for t in e.token_ids))
        with gate:
            reader.start()
            assert wait_for(lambda: _lock_waiters(lock) >= 1, 60), process_cluster.logs()
            for name, endpoint in process_cluster.node_endpoints.items():
                assert ping(endpoint, timeout=10) is not None, f"node {name} went silent waiting for the lock"
            assert reader.is_alive() and got == []  # the gate holds the lock: no node computes
        reader.join(60)
    gate.close()
    assert not reader.is_alive() and got == expected


def _lock_waiters(path: Path) -> int:
    """How many open files wait in ``flock`` for the file at ``path`` (``/proc/locks``
    lists each blocked request as ``-> FLOCK ...``): what any process sees of a node stuck
    behind the lock, whichever thread of it waits."""
    inode = path.stat().st_ino
    waiting = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and any(f.rsplit(":", 1)[-1] == str(inode) for f in fields):
            waiting += 1
    return waiting


def _receive(sock: zmq.Socket, kinds: tuple[type, ...], timeout: float) -> p.Message | None:
    """The next frame on ``sock`` of one of ``kinds`` (others skipped), or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while sock.poll(max(0.0, deadline - time.monotonic()) * 1000):
        frames = sock.recv_multipart()
        msg = p.decode(p.split_envelope(frames)[1] if sock.type == zmq.ROUTER else frames)[0]
        if isinstance(msg, kinds):
            return msg
    return None


def test_a_node_waiting_for_the_lock_answers_pings_and_runs_the_hop_once_it_is_free(tmp_path, tiny_models, ctx):
    """Another holder (an open file of its own, as a neighbour node's) keeps the compute lock
    for several seconds while a FORWARD waits at the node: the node answers every PING over
    its ROUTER all that while, and computes the hop, answering with its TOKEN, only once the
    lock is let go."""
    path = tmp_path / "compute.lock"
    with _lone_node(path, tiny_models("llama"), ctx) as (peer, head, forward):
        with ComputeLock(str(path)):
            peer.send_multipart(forward)
            assert wait_for(lambda: _lock_waiters(path) == 1, 30), "the hop never waited for the lock"
            for nonce in range(1, 7):  # pings over ~3 s, each answered while the lock is held
                peer.send_multipart(p.encode(p.Ping(nonce)))
                pong = _receive(peer, (p.Pong,), 10.0)
                assert pong is not None and pong.nonce == nonce, f"PING {nonce} was not answered"
                assert _receive(head, (p.Token,), 0.5) is None, "the hop ran while another held the lock"
            assert _lock_waiters(path) == 1
        token = _receive(head, (p.Token,), 60.0)
        assert token is not None and token.session == "lock-test" and token.pos == 8
        assert _lock_waiters(path) == 0


@contextlib.contextmanager
def _lone_node(path: Path, model: Path, ctx, wrap=None):
    """A node of ``model``'s 6 layers serving in a thread with the compute lock at ``path`` (``wrap``
    sees it first); yields a DEALER connected to it, a ROUTER standing in for the head (TOKEN and
    PROGRESS come there), and the frames of a FORWARD of 8 prompt tokens answered there. The
    node has stopped once the block ends."""
    node = Node(NodeConfig.build(resolve(str(model)), Shard(0, 5, 6), tracker=None, progress=False,
                                 node_id="lock-node", compute_lock=str(path)))
    if wrap is not None:
        wrap(node)
    stop = threading.Event()
    serving = threading.Thread(target=node.run, args=(stop,), daemon=True)
    serving.start()
    head = ctx.socket(zmq.ROUTER)
    reply_to = f"tcp://127.0.0.1:{head.bind_to_random_port('tcp://127.0.0.1')}"
    peer = ctx.socket(zmq.DEALER)
    try:
        assert node.ready.wait(30)
        peer.connect(node.endpoint)
        spec, buf = to_wire(torch.tensor([prompt_ids(model)[:8]]))
        yield peer, head, p.encode(p.Forward(session="lock-test", step=0, pos=0, start_layer=0, end_layer=5,
                                             route=(), reply_to=reply_to, tensors=(spec,)), [buf])
    finally:
        stop.set()
        serving.join(30)
    assert not serving.is_alive()


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_a_request_is_granted_through_its_fd_once_the_holder_lets_go(tmp_path):
    """``request`` never blocks: with the file free it holds it at once; while another open
    file holds it, the waiter waits, and ``fileno()`` turns readable when the lock is ours.
    A ``with`` meanwhile shares the grant: the file stays locked for the request."""
    path = str(tmp_path / "compute.lock")
    loop, other, third = ComputeLock(path), ComputeLock(path), ComputeLock(path)
    assert loop.request() and not loop.pending
    loop.release()
    with other:
        assert not loop.request() and loop.pending and not loop.request()
        assert not _readable(loop.fileno(), 0.2)
    assert _readable(loop.fileno(), 30)
    with loop:  # nested in the grant: takes nothing more, lets nothing go
        pass
    assert not third.request()  # the waiter holds it for the loop
    assert loop.request() and not loop.pending and not _readable(loop.fileno(), 0)
    loop.release()
    assert _readable(third.fileno(), 30) and third.request()
    third.release()
    for lock in (loop, other, third):
        lock.close()


def test_closing_a_lock_whose_waiter_is_blocked_frees_the_file_once_flock_returns(tmp_path):
    path = str(tmp_path / "compute.lock")
    loop, other = ComputeLock(path), ComputeLock(path)
    with other:
        assert not loop.request()
        waiter = loop._waiter._thread
        loop.close()  # the waiter is stuck in flock: it closes the file when that returns
    waiter.join(30)
    assert not waiter.is_alive()
    assert other.request()  # the closed file no longer holds the lock
    other.release()
    other.close()


def test_a_pass_lets_the_lock_go_before_its_results_are_sent(tmp_path, tiny_models, ctx):
    """The node a pass's TOKEN or FORWARD wakes may share this machine's lock: it finds the lock
    free, instead of asking, waiting in ``flock`` and being woken once the sender is done."""
    path = tmp_path / "compute.lock"
    free_when_sent = []

    def watch(node):
        send = node._send

        def watched(endpoint, key, message):
            if isinstance(message, p.Token):
                other = os.open(path, os.O_RDWR)  # another node's open file
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    free_when_sent.append(True)
                except BlockingIOError:
                    free_when_sent.append(False)
                finally:
                    os.close(other)
            send(endpoint, key, message)

        node._send = watched

    with _lone_node(path, tiny_models("llama"), ctx, watch) as (peer, head, forward):
        peer.send_multipart(forward)
        token = _receive(head, (p.Token,), 60.0)
        assert token is not None and token.pos == 8
    assert free_when_sent == [True]


# --------------------------------------------------------------------------- the core that computed last


def test_a_turn_handed_over_names_the_cpu_the_last_pass_ran_on(tmp_path, monkeypatch):
    """``note_cpu`` writes the CPU and the process into the lock file; ``handed_cpu`` reads the
    CPU back only where another process noted it (a turn handed over), else -1."""
    path = str(tmp_path / "compute.lock")
    mine, theirs = ComputeLock(path), ComputeLock(path)
    assert mine.handed_cpu() == -1  # nothing noted yet
    mine.note_cpu(1)
    assert theirs.handed_cpu() == -1  # this process's own pass: nothing handed over
    _note_as_another_process(theirs, 3, monkeypatch)
    assert mine.handed_cpu() == 3
    assert ComputeLock(None).handed_cpu() == -1
    for lock in (mine, theirs):
        lock.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_one_thread_pass_handed_over_runs_on_the_cpu_that_computed_last(tmp_path, monkeypatch):
    """A one-thread pass that takes its turn from another node runs on the CPU that node's
    pass ran on (its thread pinned there for the pass alone) and notes its own; a pass on more
    threads, a decode pass without the lock, or one after this node's own pass is not pinned."""
    from fabric.compute.compute_lock import current_cpu
    from fabric.node.hops import HopRunner

    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    seen = []

    class Executor:
        rolled_back = 0

        def run(self, *args, **kwargs):
            seen.append((os.sched_getaffinity(0), current_cpu()))
            return None

        def finish(self):
            pass

    class Work:
        msg = p.Forward(session="s", step=0, pos=3, start_layer=0, end_layer=2, route=(), reply_to="tcp://h:1")
        tensor, tokens, decode = torch.zeros((1, 1), dtype=torch.int64), 1, True

    path = str(tmp_path / "compute.lock")
    lock, other = ComputeLock(path), ComputeLock(path)
    runner = HopRunner(Executor(), lock, collections.Counter())
    runner.step_threads = 1
    _note_as_another_process(other, cpu, monkeypatch)  # another node's pass ran there
    runner.run([Work()])
    assert seen[-1] == ({cpu}, cpu) and os.sched_getaffinity(0) == allowed  # pinned for the pass alone
    assert lock.handed_cpu() == -1  # it noted its own CPU: the next turn, if its own, is not pinned
    runner.run([Work()])
    assert seen[-1][0] == allowed
    runner.step_threads = 0  # every thread
    if torch.get_num_threads() > 1:
        _note_as_another_process(other, cpu, monkeypatch)
        runner.run([Work()])
        assert seen[-1][0] == allowed
    for each in (lock, other):
        each.close()


def _note_as_another_process(lock: ComputeLock, cpu: int, monkeypatch) -> None:
    """``lock.note_cpu(cpu)`` as a process other than this one would write it."""
    monkeypatch.setattr(os, "getpid", lambda: 4_000_000)
    lock.note_cpu(cpu)
    monkeypatch.undo()
