"""The README's "Several machines" walk-through, run verbatim on two test-bed hosts.

Host A and host B are network namespaces, each with its own HOME; B runs its own virtual
environment, where the default model is installed again under another path. The commands
are read from README.md itself (keys, the key copies, tracker, web UI, both nodes, status,
chat), with the README's example addresses replaced by the hosts' and ``--keys DIR`` added
to every command after the keys step, as the README says. The chat's text must equal
transformers' greedy reply of the same GGUF in one process, in the nodes' default mode (the
file's own grid).
"""
from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from tests import netbed
from tests.support.areas import skip_area

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = {"A": "192.0.2.10", "B": "192.0.2.11"}  # the README's addresses for A and B

pytestmark = pytest.mark.slow


def walkthrough() -> dict:
    """The walk-through's commands, by step, parsed from README.md."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Several machines"):]
    section = section[:section.index("\n### ")]
    flat = re.sub(r"\s+", " ", section)
    keys = re.search(r"on A `(meshnet keys [^`]+)`, on B `(meshnet keys [^`]+)`", flat)
    copies = re.search(r"Copy A's `([^`]+)` to B as `([^`]+)`, and B's `([^`]+)` to A as `([^`]+)`", flat)
    add = re.search(r"Add `(--keys [^`]+)` to every command that follows", flat)
    blocks = [textwrap.dedent(b) for b in re.findall(r"```\n(.*?)```", section, re.S)]
    start_a = next(b for b in blocks if "meshnet tracker" in b)  # step 4 (step 1's block is the from-peers case)
    nodes = next(b for b in blocks if re.search(r"^# on A$", b, re.M))  # step 5
    node_a, node_b = re.split(r"^# on B$", re.sub(r"^# on A$\n", "", nodes, flags=re.M), flags=re.M)
    status = re.search(r"`(meshnet status --tracker [^`]+)`", flat)
    chat = re.search(r"`(meshnet chat --tracker [^`]+)`", flat)
    assert keys and copies and add and status and chat, "the README's walk-through changed shape: update this test"
    return {"keys": keys.groups(), "copies": copies.groups(), "add": add[1],
            "services_a": _commands(start_a), "node_a": _commands(node_a)[0], "node_b": _commands(node_b)[0],
            "status": status[1], "chat": chat[1]}


def _commands(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_walkthrough_parses():
    steps = walkthrough()
    assert steps["keys"][0].endswith("--tracker") and len(steps["services_a"]) == 2
    assert all(c.startswith("meshnet ") for c in [steps["node_a"], steps["node_b"], *steps["services_a"]])
    assert EXAMPLE["A"] in steps["node_a"] and EXAMPLE["B"] in steps["node_b"]


@pytest.fixture
def two_machines(tmp_path):
    if reason := netbed.unavailable():
        skip_area("namespaces", reason)
    from fabric.compute.models import ALIASES, alias_path

    if alias_path(ALIASES["smollm2-135m"]) is None:
        skip_area("smollm2", "smollm2-135m is not installed (meshnet pull smollm2-135m)")
    with netbed.Netbed(tmp_path / "bed", cache=None) as bed:  # each host parses the GGUF under its own HOME
        bed.add_host("a")
        bed.add_host("b", venv=True)
        yield bed


def test_the_readme_walkthrough_on_two_hosts(two_machines):
    bed, steps = two_machines, walkthrough()
    ips = {"A": bed.hosts["a"].ip, "B": bed.hosts["b"].ip}

    def here(command: str) -> str:
        for name, example in EXAMPLE.items():
            command = command.replace(example, ips[name])
        return command

    def run(host: str, command: str, timeout: float = 120.0) -> str:
        done = bed.shell(host, here(command), timeout)
        assert done.returncode == 0, f"{host}$ {command}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    run("a", steps["keys"][0])
    run("b", steps["keys"][1])
    copy_keys(bed, steps["copies"])
    keys = " " + steps["add"]
    for i, command in enumerate(steps["services_a"]):
        bed.spawn_shell("a", f"a-service-{i}", here(command) + keys)
    bed.spawn_shell("a", "node-a", here(steps["node_a"]) + keys)
    bed.spawn_shell("b", "node-b", here(steps["node_b"]) + keys)
    status = wait_for_route(bed, lambda: run("b", steps["status"] + keys + " --json"))
    assert len({n["fingerprint"] for n in status["nodes"]}) == 1, status["nodes"]
    hops = [(h["start_layer"], h["end_layer"]) for h in status["plans"]["smollm2-135m"][0]["hops"]]
    assert hops == [(0, 14), (15, 29)]
    shown = run("a", steps["status"] + keys)
    assert "plan 1:" in shown and "weights differ" not in shown
    reply = run("b", steps["chat"] + keys + " </dev/null", timeout=300)
    assert reply.strip() and reply.strip() == reference_reply("Hello").strip()


def copy_keys(bed, copies: tuple[str, ...]) -> None:
    """Copy A's public key to B and B's to A, as the README says (paths under each HOME)."""
    a_key, b_as, b_key, a_as = copies
    if "/" not in b_key:  # "B's `id.key`": in the same key folder as A's
        b_key = str(Path(a_key).parent / b_key)
    home = {name: h.home for name, h in bed.hosts.items()}

    def local(host: str, path: str) -> Path:
        return home[host] / path.removeprefix("~/")

    local("b", b_as).write_bytes(local("a", a_key).read_bytes())
    local("a", a_as).write_bytes(local("b", b_key).read_bytes())


def wait_for_route(bed, status_json, timeout: float = 240.0) -> dict:
    import json

    deadline = time.monotonic() + timeout
    while True:
        dead = [name for name, proc in bed.procs.items() if proc.poll() is not None]
        assert not dead, f"{dead} exited\n{bed.logs()}"
        try:
            status = json.loads(status_json())
            if len(status["nodes"]) == 2 and status["plans"].get("smollm2-135m"):
                return status
        except AssertionError:
            pass  # the tracker is not up yet
        assert time.monotonic() < deadline, f"no route in {timeout}s\n{bed.logs()}"
        time.sleep(1)


def reference_reply(prompt: str, max_new_tokens: int = 256) -> str:
    """transformers' greedy reply in one process, from the same GGUF in the nodes' default
    mode: on the file's own grid (``--quant auto``), computed as they compute it."""
    import torch
    from transformers import AutoTokenizer

    from fabric.compute.models import ALIASES, _one_metadata_parse, alias_path, pick_quant, resolve
    from tests.support.references import quantized_reference

    path = alias_path(ALIASES["smollm2-135m"])
    scheme, _ = pick_quant("auto", resolve("smollm2-135m"))
    with _one_metadata_parse():  # one parse for both, read through a plain array (tests/test_gguf_models.py)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = quantized_reference(path.parent, path.name, scheme)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
