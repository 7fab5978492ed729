"""The test zygote (tests/zygote.py) gives ``ProcessCluster`` forked nodes that behave as
processes of their own: these checks hold it to ``subprocess.Popen``'s contract, which the
fault tests rely on (a SIGKILL kills that node alone; a refusal's status and line come back)."""
from __future__ import annotations

import os
import signal

import pytest

from tests.zygote import ZYGOTE, Forked


@pytest.fixture
def cluster(process_cluster, monkeypatch):
    """conftest's ``process_cluster``, forking its nodes even where the run says not to."""
    monkeypatch.delenv("MESHNET_TEST_FORK", raising=False)
    return process_cluster


def test_a_forked_node_is_a_process_of_its_own_and_dies_alone(cluster, tiny_models):
    model = tiny_models("llama")
    cluster.split(model)
    a, b = cluster.procs["a"], cluster.procs["b"]
    assert isinstance(a, Forked) and isinstance(b, Forked), "the nodes were not forked"
    assert len({a.pid, b.pid, os.getpid(), ZYGOTE.proc.pid}) == 4
    assert os.getpgid(a.pid) == os.getpgid(ZYGOTE.proc.pid)
    a.send_signal(signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL
    assert b.poll() is None and ZYGOTE.proc.poll() is None
    b.send_signal(signal.SIGINT)  # Ctrl-C: the node stops cleanly
    assert b.wait(30) == 0, cluster.logs()
    assert "node stopped" in (cluster.tmp / "b.log").read_text()


def test_a_forked_refusal_gives_its_status_and_its_one_line(cluster, tiny_models):
    cluster._spawn("bad", "node", "--model", str(tiny_models("llama")), "--layers", "4-2")
    proc = cluster.procs["bad"]
    assert isinstance(proc, Forked)
    assert proc.wait(60) == 2
    log = (cluster.tmp / "bad.log").read_text()
    assert "meshnet: error:" in log and "Traceback" not in log, log


def test_a_node_with_another_home_gets_a_fresh_interpreter(cluster, tiny_models, tmp_path):
    """huggingface_hub reads HOME and XDG_CACHE_HOME once, when it loads: a fork would keep the
    zygote's. So a node with another environment is started as a new process."""
    cluster.start_node("a", str(tiny_models("llama")), "0-5", None, env={"XDG_CACHE_HOME": str(tmp_path / "other")})
    assert not isinstance(cluster.procs["a"], Forked)
    cluster.wait_nodes(["a"], tiny_models("llama").name)


def test_a_lying_node_is_forked_and_still_lies(cluster, tiny_models):
    """tests/liar_node.py patches the executor, then runs meshnet: forked, it runs as
    ``python tests/liar_node.py`` would, and its tail's tokens are not the model's."""
    from tests.test_fabric_equivalence import generated_ids, prompt_ids
    from tests.tiny_models import reference_greedy

    model = tiny_models("llama")
    cluster.start_node("a", str(model), "0-2")
    cluster.start_node("b", str(model), "3-5", liar=True)
    assert isinstance(cluster.procs["b"], Forked), "the lying node was not forked"
    cluster.wait_nodes(["a", "b"], model.name)
    with cluster.client() as client:
        lied = generated_ids(client, model.name)
    assert lied != reference_greedy(model, prompt_ids(model), len(lied))
