"""The `meshnet` command line as a user types it."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.cluster import ROOT, free_port


def meshnet(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fabric.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_lists_every_command():
    out = meshnet("--help")
    assert out.returncode == 0
    for command in ("up", "tracker", "node", "webui", "chat", "status"):
        assert command in out.stdout
    node_help = meshnet("node", "--help").stdout
    assert "--layers" in node_help and "--advertise" in node_help and "--dtype" in node_help


def test_unknown_model_is_a_clear_error():
    out = meshnet("node", "--model", "no-such-model", "--layers", "0-1")
    assert out.returncode == 2
    assert "unknown model 'no-such-model'" in out.stderr


def test_bad_layer_range_is_a_clear_error(tiny_models):
    out = meshnet("node", "--model", str(tiny_models("llama")), "--layers", "3-9")
    assert out.returncode == 2 and "do not fit a 6-layer model" in out.stderr
    out = meshnet("node", "--model", str(tiny_models("llama")), "--layers", "three")
    assert out.returncode == 2 and "inclusive range like 0-14" in out.stderr


def test_a_device_or_quantization_that_cannot_run_here_stops_up_and_node_before_they_start():
    import torch

    if not torch.cuda.is_available():
        for command in ("up", "node"):
            out = meshnet(command, "--model", "no-such-model", "--device", "cuda", "--tracker",
                          f"tcp://127.0.0.1:{free_port()}")
            assert out.returncode == 2 and "--device cuda: no CUDA device is available here" in out.stderr
    out = meshnet("node", "--model", "no-such-model", "--device", "gpu")
    assert out.returncode == 2 and "'gpu' is not cpu, cuda or cuda:N" in out.stderr
    out = meshnet("up", "--device", "cuda", "--quant", "int8", "--tracker", f"tcp://127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "--quant int8 runs on the CPU kernels" in out.stderr
    assert "meshnet is up" not in out.stdout + out.stderr


def test_up_refuses_ports_another_cluster_holds_before_starting_anything():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = [f"tcp://127.0.0.1:{free_port()}", str(free_port())]
        out = meshnet("up", "--tracker", f"tcp://127.0.0.1:{port}", "--pub", free[0], "--port", free[1], timeout=60)
        assert out.returncode == 2
        assert f"already in use on this machine: port {port} (the tracker, --tracker)." in out.stderr
        out = meshnet("up", "--tracker", free[0], "--pub", f"tcp://127.0.0.1:{free_port()}", "--port", str(port),
                      timeout=60)
        assert out.returncode == 2
        assert f"already in use on this machine: port {port} (the web UI, --port)." in out.stderr
        assert "starting a tracker" not in out.stderr and "meshnet is up" not in out.stdout


def test_up_deals_its_nodes_out_over_the_gpus_only_for_plain_cuda():
    from fabric.cli.up_command import node_devices

    assert node_devices("cpu", 2, 0) == ["cpu", "cpu"]
    assert node_devices("cuda", 3, 2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert node_devices("cuda", 2, 1) == ["cuda", "cuda"]
    assert node_devices("cuda:1", 2, 4) == ["cuda:1", "cuda:1"]  # the user named one GPU


def test_up_serves_the_model_split_in_two_and_ctrl_c_stops_every_process(tiny_models, tmp_path):
    """`meshnet up` as a user runs it: tracker, two nodes and the web UI come up, a request
    through the fabric equals one transformers process, and one Ctrl-C ends everything."""
    import os
    import signal
    import urllib.request

    import psutil

    from fabric import Client
    from tests.test_fabric_equivalence import MESSAGES, NEW_TOKENS, generated_ids, prompt_ids
    from tests.tiny_models import reference_greedy

    model = tiny_models("llama")
    tracker, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "XDG_RUNTIME_DIR": str(tmp_path / "run")}  # its nodes' compute lock: theirs alone
    up = subprocess.Popen([sys.executable, "-m", "fabric.cli", "up", "--model", str(model), "--nodes", "2",
                           "--port", str(port), "--tracker", tracker, "--pub", f"tcp://127.0.0.1:{free_port()}",
                           "--draft", str(model)],  # the model drafting for itself: the text stays the same
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list = []
    try:
        lines = []
        for line in up.stdout:  # until it says it is up (or exits)
            lines.append(line)
            if "meshnet is up" in line:
                break
        assert any(f"http://127.0.0.1:{port}" in line for line in lines), "".join(lines)
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 4  # tracker, two nodes, web UI
        drafting = [c.cmdline()[c.cmdline().index("--layers") + 1] for c in children if "--draft" in c.cmdline()]
        assert len(drafting) == 1 and drafting[0].startswith("0-")  # the head of every request, alone
        with Client(tracker, timeout=60) as client:
            assert generated_ids(client, model.name) == reference_greedy(model, prompt_ids(model), NEW_TOKENS)
        body = json.dumps({"model": model.name, "messages": MESSAGES, "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["usage"]["completion_tokens"] > 0
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:  # a failed assertion must not leave a cluster running
        for child in children:
            if child.is_running():
                child.kill()
        if up.poll() is None:
            up.kill()


def test_status_without_a_tracker_fails_fast():
    out = meshnet("status", "--tracker", f"tcp://127.0.0.1:{free_port()}", timeout=30)
    assert out.returncode == 1 and "did not answer: nothing listens on that port" in out.stderr  # refused: at once


def test_chat_without_a_tracker_fails_fast():
    # the client waits up to 30 s for a head's next token, but not that long for a tracker that is not there
    out = meshnet("chat", "--tracker", f"tcp://127.0.0.1:{free_port()}", "Hello", timeout=25)
    assert out.returncode == 1 and "did not answer: nothing listens on that port" in out.stderr


def test_status_json_and_chat_against_a_cluster(process_cluster, tiny_models):
    model = tiny_models("llama")
    process_cluster.split(model)
    status = json.loads(meshnet("status", "--tracker", process_cluster.endpoint, "--json").stdout)
    nodes = {n["id"]: n for n in status["nodes"]}
    assert nodes["a"]["layers"] == [0, 2] and nodes["b"]["layers"] == [3, 5]
    assert {"id", "endpoint", "model", "layers", "sessions"} <= set(nodes["a"])
    plan = status["plans"][model.name][0]
    assert {"hops", "estimated_tps"} <= set(plan)
    assert {"node", "endpoint", "start_layer", "end_layer"} <= set(plan["hops"][0])
    table = meshnet("status", "--tracker", process_cluster.endpoint).stdout
    assert "plan 1:" in table and "|" in table
    chat = meshnet("chat", "--tracker", process_cluster.endpoint, "--model", model.name, "--max-tokens", "8", "hi")
    assert chat.returncode == 0 and chat.stdout.strip()
