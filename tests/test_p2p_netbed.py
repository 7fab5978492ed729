"""Weights from peers between two machines: the README walk-through's step 1 alternative, run
from the README on two test-bed hosts.

Host A and host B are network namespaces with their own HOMEs (and no shared cache). The model
file lies in A's HOME, and B's processes run in a mount namespace where A's HOME is an empty
read-only tmpfs: even as root, nothing on B can read A's copy (the test checks that it cannot).
B's `meshnet node --model my-model --layers ...` (the README's line) finds no file named
`my-model`, fetches its layers from A's node over the bed's link, and serves them; its
answers equal transformers' float32 greedy tokens of the whole file in one process (exact
mode: `--quant none --dtype float32` added to both nodes' lines), and B keeps less than 70%
of the file on disk.

The model is a random 30-layer llama GGUF made in the test (the README's 0-14 | 15-29 apply
as written): only the addresses are replaced by the hosts'.
"""
from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from tests import netbed
from tests.gguf_models import write_gguf
from tests.support.areas import skip_area
from tests.test_p2p_weights import EXACT, NEW_TOKENS, RAW_PROMPT, float32_greedy

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = {"A": "192.0.2.10", "B": "192.0.2.11"}  # the README's addresses for A and B
MODEL = "my-model"  # the README's model id: A's file is ~/models/my-model.gguf
LAYERS = 30

pytestmark = pytest.mark.slow


def from_peers_commands() -> tuple[str, str]:
    """A's and B's `meshnet node` lines of the walk-through's step 1 alternative (README.md)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Several machines"):]
    section = section[:section.index("\n### ")]
    block = next((textwrap.dedent(b) for b in re.findall(r"```\n(.*?)```", section, re.S) if "with no copy" in b), None)
    assert block is not None, "the README's from-peers block changed shape: update this test"
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == 2 and all(line.startswith("meshnet node ") for line in lines), lines
    return lines[0], lines[1]


def test_the_readme_from_peers_lines_parse():
    node_a, node_b = from_peers_commands()
    assert f"--model ~/models/{MODEL}.gguf" in node_a and EXAMPLE["A"] in node_a
    assert f"--model {MODEL} " in node_b and "--layers 15-29" in node_b and EXAMPLE["B"] in node_b


@pytest.fixture
def two_machines(tmp_path):
    if reason := netbed.unavailable():
        skip_area("namespaces", reason)
    with netbed.Netbed(tmp_path / "bed", cache=None) as bed:  # no shared cache: each host's is under its HOME
        bed.add_host("a")
        bed.add_host("b", hide=("a",))  # A's HOME (the model file) is another machine's disk
        yield bed


def test_a_host_without_the_file_fetches_its_layers_from_the_other_and_serves(two_machines, tmp_path):
    bed = two_machines
    ips = {"A": bed.hosts["a"].ip, "B": bed.hosts["b"].ip}
    model_file = write_gguf("llama", bed.hosts["a"].home / "models", "Q8_0", num_layers=LAYERS, name=f"{MODEL}.gguf")
    want = float32_greedy(model_file, tmp_path / "reference-cache")
    seen = bed.shell("b", f"ls -A {bed.hosts['a'].home}; cat {model_file}")
    assert seen.returncode != 0 and not seen.stdout.strip(), (seen.stdout, seen.stderr)  # B cannot read A's copy

    def here(command: str) -> str:
        for name, example in EXAMPLE.items():
            command = command.replace(example, ips[name])
        return command + " " + " ".join(EXACT)

    node_a, node_b = from_peers_commands()
    bed.start_tracker("a")
    bed.spawn_shell("a", "node-a", here(node_a))
    with bed.client("b") as client:
        wait_status(client, bed, lambda s: any(ips["A"] in n["endpoint"] for n in s["nodes"]))  # B asks who has it
        bed.spawn_shell("b", "node-b", here(node_b))
        status = wait_status(client, bed, lambda s: bool(s["plans"].get(MODEL)))  # A alone covers 0-14 only
        assert len({n["fingerprint"] for n in status["nodes"]}) == 1, status["nodes"]
        events = list(client.generate(MODEL, None, max_tokens=NEW_TOKENS, prompt=RAW_PROMPT, ignore_eos=True,
                                      timeout=120))
    routes = [[(h["endpoint"], h["start_layer"], h["end_layer"]) for h in e["route"]] for e in events if e["route"]]
    assert routes and ips["B"] in routes[-1][-1][0] and routes[-1][-1][1:] == (15, 29), routes
    assert [t for e in events for t in e["ids"]] == want, bed.logs()
    b_files = [p for p in bed.hosts["b"].home.rglob("*.gguf") if p.is_file()]
    assert len(b_files) == 1 and b_files[0].parent.name == "peers", b_files
    assert b_files[0].stat().st_size < 0.7 * model_file.stat().st_size, (b_files[0].stat().st_size,
                                                                        model_file.stat().st_size)


def wait_status(client, bed, ready, timeout: float = 240.0) -> dict:
    """The tracker's status once ``ready(status)``; fails at once if a process of the bed exited."""
    deadline = time.monotonic() + timeout
    while True:
        dead = [name for name, proc in bed.procs.items() if proc.poll() is not None]
        assert not dead, f"{dead} exited\n{bed.logs()}"
        try:
            status = client.status(timeout=2.0)
            if ready(status):
                return status
        except netbed.AgentError:
            pass
        assert time.monotonic() < deadline, f"not ready in {timeout}s\n{bed.logs()}"
        time.sleep(0.5)
