"""Nodes on one host share the compute by default: every node of a user on a device locks the
same file, so two `meshnet node` processes started by hand take turns as `meshnet up`'s do."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fabric.cli import _compute_lock
from fabric.compute.compute_lock import ComputeLock, LockDirError, default_path, private_dir
from fabric.flags import CommandError
from tests.test_fabric_equivalence import MESSAGES, prompt_ids
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
    fds = Path(f"/proc/{pid}/fd")
    return {os.readlink(fd) for fd in fds.iterdir() if not os.readlink(fd).startswith(("socket:", "pipe:", "anon"))}


def test_two_standalone_nodes_take_turns_at_the_default_lock(process_cluster, tiny_models):
    """Two `meshnet node` processes with no --compute-lock on one host (one runtime
    directory) open the same default file, and while another process holds it exclusively
    neither computes a step: the reply comes only once it is let go, and equals the reference."""
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
            reader.join(1.5)
            assert reader.is_alive() and got == []  # the gate holds the lock: no node computes
        reader.join(60)
    gate.close()
    assert not reader.is_alive() and got == expected
