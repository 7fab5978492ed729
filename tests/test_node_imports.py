"""What a node process imports, and a web UI's: real ``meshnet node`` and ``meshnet webui``
processes run under ``python -X importtime``, which lists every module the process imported,
from start-up through a served request.

A node's runtime floor is mostly modules: what it imports for nothing (the web UI, the packages
``fabric.cli.torch_env.NOT_IN_A_NODE`` leaves out) is memory every node carries; and a module a
node needs must come in at start, not in the middle of a request."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fabric.cli.torch_env import NOT_IN_A_NODE
from tests.test_processes import token_ids

IMPORTTIME = ("-X", "importtime", "-m", "fabric.cli")
NEVER = {*NOT_IN_A_NODE, "quart", "hypercorn", "webui",  # the web UI runs in its own process
         "sympy"}  # torch's symbolic shapes, for meta tensors and the compiler (fabric/compute/empty.py)
COMPILER = ("torch._inductor", "torch.onnx", "torch.distributed.tensor")  # a node never compiles nor joins a group


def imported(log: Path) -> list[str]:
    """Every module the process imported, in order (``-X importtime`` lines on its stderr)."""
    return re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$", log.read_text(), re.MULTILINE)


def loaded(modules: set[str], packages: set[str]) -> list[str]:
    """Those of ``packages`` that ran: one of their submodules was imported. A package left out
    (None in sys.modules) is listed too where something tried it, alone: ``try: import trio``."""
    return sorted({m.split(".")[0] for m in modules if "." in m and m.split(".")[0] in packages})


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_nodes_import_neither_the_web_ui_nor_what_they_leave_out_nor_anything_mid_request(process_cluster,
                                                                                           tiny_models, family):
    model = tiny_models(family)
    for name, layers in (("a", "0-2"), ("b", "3-5")):
        process_cluster._spawn(name, "node", "--model", str(model), "--layers", layers, "--node-id", name,
                               "--tracker", process_cluster.endpoint, "--threads", "1", "--no-progress",
                               "--heartbeat", str(process_cluster.heartbeat), entry=IMPORTTIME)
    process_cluster.wait_nodes(["a", "b"], model.name)
    logs = [process_cluster.tmp / f"{n}.log" for n in ("a", "b")]
    at_start = [set(imported(log)) for log in logs]
    with process_cluster.client() as client:  # a request: what its path imports is listed too
        assert token_ids(client.generate(model.name, prompt="The history of", max_tokens=8, ignore_eos=True))
    head, tail = (set(imported(log)) for log in logs)
    assert "fabric.node.node" in head and "fabric.node.node" in tail, "the logs list no imports"
    for modules in (head, tail):
        assert not loaded(modules, NEVER), loaded(modules, NEVER)
        assert not modules.intersection(COMPILER), modules.intersection(COMPILER)
    mid = {n: sorted(after - before) for n, before, after in zip("ab", at_start, (head, tail)) if after - before}
    assert not mid, f"imported in the middle of a request, where a missing package would fail it: {mid}"


def test_the_web_ui_answers_without_torch_or_transformers(process_cluster):
    """The web UI process checks a request's grammar (fabric/compute/grammar_text.py) and
    renders nothing a model computes: it starts in under a second without torch."""
    from tests.test_tracker_away import _post

    url = process_cluster.start_webui(entry=IMPORTTIME)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    status, _, _ = _post(url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": bad})
    assert status == 400
    modules = set(imported(process_cluster.tmp / "webui.log"))
    assert "webui.grammar_fields" in modules and not loaded(modules, {"torch", "transformers"})
