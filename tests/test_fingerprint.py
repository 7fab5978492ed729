"""A model's fingerprint: equal for the same weights on any machine, different for other weights.

Nodes chain only when their fingerprints match, so a fingerprint that hashed a local path
(the GGUF metadata cache under $HOME, an alias's site-packages) kept two real machines
from ever forming a route.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from fabric.compute.models import (
    ALIASES,
    alias_path,
    architecture,
    fingerprint,
    load_config,
    resolve,
)
from tests.support.areas import skip_area

ROOT = Path(__file__).resolve().parent.parent

# Computes the fingerprints the way a node does (one line per quantization named, "" for
# none), in a fresh interpreter with its own HOME.
_PROBE = """
import sys
from fabric.compute.models import default_cache_root, fingerprint, load_config, resolve
source = resolve(sys.argv[1])
config = load_config(source, default_cache_root())
for quant in sys.argv[2:]:
    print("fingerprint:", fingerprint(source, config, quant or None))
"""


def node_fingerprints(ref: str, home: Path, *quants: str) -> subprocess.Popen:
    """The fingerprints (read them with ``read``) a node started with HOME=home would register
    with each of ``quants`` (no XDG overrides)."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    return subprocess.Popen([sys.executable, "-c", _PROBE, ref, *quants], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=home,
                            env={**env, "HOME": str(home), "PYTHONPATH": str(ROOT)})


def read(probe: subprocess.Popen) -> list[str]:
    out, err = probe.communicate(timeout=300)
    assert probe.returncode == 0, err
    return [line.split()[1] for line in out.splitlines() if line.startswith("fingerprint: ")]


def test_a_config_loses_its_local_paths(tiny_models, tmp_path):
    copy = shutil.copytree(tiny_models("llama"), tmp_path / "elsewhere" / "llama")
    config = load_config(resolve(str(copy)))
    assert str(tmp_path) in json.dumps(config.to_dict(), default=str)  # what used to be hashed
    arch = architecture(config)
    assert str(tmp_path) not in json.dumps(arch, default=str)
    assert "_name_or_path" not in arch and "transformers_version" not in arch
    assert arch["num_hidden_layers"] == 6 and arch["hidden_size"] == 64


def test_same_weights_in_other_directories_and_homes_agree(tiny_models, tmp_path):
    model = tiny_models("llama")
    a = shutil.copytree(model, tmp_path / "alice" / "models" / "tiny")
    b = shutil.copytree(model, tmp_path / "bob" / "venv" / "lib" / "tiny-llama")
    fa = fingerprint(resolve(str(a)), load_config(resolve(str(a)), tmp_path / "alice" / ".cache"))
    fb = fingerprint(resolve(str(b)), load_config(resolve(str(b)), tmp_path / "bob" / ".cache"))
    assert fa == fb


def test_other_weights_or_quantization_differ(tiny_models, tmp_path):
    model = tiny_models("llama")
    source = resolve(str(model))
    base = fingerprint(source, load_config(source))
    assert fingerprint(source, load_config(source), "int8") != base
    assert fingerprint(source, load_config(source), "int8") != fingerprint(source, load_config(source), "int4")
    assert fingerprint(source, load_config(source), "none") == base

    changed = shutil.copytree(model, tmp_path / "changed")
    weights = changed / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in tensors if "layers.5" in n)
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    other = resolve(str(changed))
    assert fingerprint(other, load_config(other)) != base


def test_another_architecture_differs(tiny_models):
    llama, qwen2 = resolve(str(tiny_models("llama"))), resolve(str(tiny_models("qwen2")))
    assert fingerprint(llama, load_config(llama)) != fingerprint(qwen2, load_config(qwen2))


@pytest.mark.slow
def test_the_alias_agrees_across_homes_and_install_paths(tmp_path):
    """The default GGUF: parsed under two HOMEs (two metadata caches), installed in this
    Python and copied into another install location, as on two machines."""
    installed = alias_path(ALIASES["smollm2-135m"])
    if installed is None:
        skip_area("smollm2", "smollm2-135m is not installed (meshnet pull smollm2-135m)")
    copy = tmp_path / "site-packages" / installed.parent.name / installed.name
    copy.parent.mkdir(parents=True)
    shutil.copyfile(installed, copy)
    alice = node_fingerprints("smollm2-135m", tmp_path / "home-alice", "")  # the two at once: a parse takes seconds
    bob = node_fingerprints(str(copy), tmp_path / "home-bob", "", "int4")
    (at_alice,), (at_bob, at_bob_int4) = read(alice), read(bob)
    assert at_alice == at_bob
    assert at_bob_int4 == at_bob + ":int4"
