"""What a GGUF file holds, and whether a meshnet node can run it, read off its header alone.

``meshnet models FILE`` prints it (architecture, shape, chat template, the tensor types and
the bytes of each layer); ``meshnet node --model FILE`` asks :func:`check_runnable` before
anything loads, so a file no node can run is one line naming the file and what is wrong:
an architecture meshnet does not run, a tensor type gguf-py cannot dequantize (or does not
know), a file cut short, or not GGUF at all.

The header is stepped through with ``struct`` (no torch; gguf-py only for its type table):
metadata arrays are decoded only where asked (the vocabulary, when a chat template must be
chosen), so a 262k-token vocabulary costs nothing otherwise.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants  # numpy only, no torch

from .model_ref import _LAYER_RE, ModelError, resolve, scheme_of
from .templates import choose

# llama.cpp architectures meshnet runs (the test suite runs each end to end: tests/gguf_models.py), and
# the model_type transformers makes of them. transformers reads more (mamba, t5, ...); meshnet does not run them.
RUNS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
        "gemma2": "gemma2", "gemma3": "gemma3_text"}
EMBED_TENSOR, OUTPUT_TENSOR = "token_embd.weight", "output.weight"
TOKENS = "tokenizer.ggml.tokens"
CHAT_TEMPLATE = "tokenizer.chat_template"
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32  # where general.alignment is not set

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array left undecoded: what it holds and how many."""

    item_type: int  # GGUF value type of its items
    count: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_id: int  # GGML type number
    type_name: str  # its name, or "type N" where gguf-py does not know it
    shape: tuple[int, ...]  # as GGUF writes it: the row length first
    offset: int  # absolute byte offset of its data
    nbytes: int | None  # None where the type's block size is not known


@dataclass(frozen=True)
class Header:
    path: Path
    size: int  # the file's bytes
    version: int
    metadata: dict  # key -> value; arrays not asked for are ArrayValue
    tensors: tuple[TensorEntry, ...]

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def key(self, suffix: str):
        """The architecture's own key (``llama.block_count``)."""
        return self.metadata.get(f"{self.architecture}.{suffix}")

    def find(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Short(Exception):
    """A read past the end of the file."""


class _Reader:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise _Short
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def string(self, keep: bool = True) -> str | None:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise _Short
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8", errors="replace") if keep else None

    def value(self, kind: int, keep: bool = True):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string(keep)
        if kind != _ARRAY:
            raise ModelError(f"its header holds a value of unknown type {kind} at byte {self.at}")
        item, count = self.take("<I"), self.take("<Q")
        if keep:
            return [self.value(item) for _ in range(count)]
        if item in _SCALARS:  # step over the lot
            self.at += count * struct.calcsize(_SCALARS[item])
            if self.at > len(self.buf):
                raise _Short
        else:
            for _ in range(count):
                self.value(item, keep=False)
        return ArrayValue(item, count)


def read_header(path: Path, arrays: frozenset[str] = frozenset()) -> Header:
    """The header of GGUF file ``path``, the metadata arrays named in ``arrays`` decoded; a
    ModelError naming the file where it is empty, not GGUF, or cut inside its header."""
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"{path.name} is empty, not a GGUF file; download it again")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ModelError(f"{path.name} is not a GGUF file (it does not start with the bytes GGUF)")
        try:
            return _parse(path, size, _Reader(m), arrays)
        except _Short:
            raise ModelError(f"{path.name} is truncated: it ends inside its header, at byte {size:,}; "
                             f"download it again") from None
        except ModelError as exc:
            raise ModelError(f"{path.name}: {exc}") from None


def _parse(path: Path, size: int, r: _Reader, arrays: frozenset[str]) -> Header:
    r.at = 4
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    if version not in (2, 3):
        raise ModelError(f"GGUF version {version}, which meshnet does not read (2 or 3); convert it again with "
                         f"a current llama.cpp")
    meta = {}
    for _ in range(n_kv):
        key, kind = r.string(), r.take("<I")
        meta[key] = r.value(kind, keep=kind != _ARRAY or key in arrays)
    infos = []
    for _ in range(n_tensors):
        name, dims = r.string(), r.take("<I")
        if dims > MAX_DIMS:
            raise ModelError(f"tensor {name} has {dims} dimensions (GGUF allows {MAX_DIMS}); the file is damaged")
        shape = tuple(r.take("<Q") for _ in range(dims))
        infos.append((name, shape, r.take("<I"), r.take("<Q")))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise ModelError(f"general.alignment is {align!r}; the file is damaged")
    start = -(-r.at // align) * align  # the data begins at the next multiple of the alignment
    tensors = tuple(_entry(name, shape, kind, start + offset) for name, shape, kind, offset in infos)
    return Header(path, size, version, meta, tensors)


def _entry(name: str, shape: tuple[int, ...], kind: int, offset: int) -> TensorEntry:
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        return TensorEntry(name, kind, f"type {kind}", shape, offset, None)
    block, type_size = GGML_QUANT_SIZES[qtype]
    return TensorEntry(name, kind, qtype.name, shape, offset, math.prod(shape) // block * type_size)


# --------------------------------------------------------------------------- can a node run it


@cache
def dequantizable(type_name: str) -> bool:
    """Can this gguf package turn tensors of GGML type ``type_name`` into floats?"""
    qtype = GGMLQuantizationType[type_name]
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def problems(header: Header) -> list[str]:
    """Why no meshnet node can run this file (empty: one can), each said in a few words."""
    found = []
    arch = header.architecture
    if arch is None:
        found.append("it names no architecture (general.architecture)")
    elif arch not in RUNS:
        found.append(f"architecture {arch!r} is not one meshnet runs (it runs {', '.join(sorted(RUNS))})")
    elif not isinstance(header.key("block_count"), int):
        found.append(f"it names no layer count ({arch}.block_count)")
    if not header.tensors:
        found.append("it holds no tensors")
    found += type_problems({t.name: t.type_name for t in header.tensors})
    cut = [t for t in header.tensors if t.nbytes is not None and t.offset + t.nbytes > header.size]
    if cut:
        found.append(f"it is truncated: it ends at byte {header.size:,}, before the data of {cut[0].name} "
                     f"({len(cut)} of {len(header.tensors)} tensors cut off); download it again")
    return found


def type_problems(types: dict[str, str]) -> list[str]:
    """Why tensors of these GGML types ({tensor name: type name}) cannot load: a type gguf-py
    does not know ("type N") or cannot dequantize. Empty: every type loads."""
    by_type = defaultdict(list)
    for name, kind in types.items():
        by_type[kind].append(name)
    version = metadata.version("gguf")
    found = []
    for kind, names in sorted(by_type.items()):
        one = len(names) == 1
        which = f"tensor {names[0]}" if one else f"{names[0]} and {len(names) - 1} more tensors"
        if kind.startswith("type "):
            found.append(f"{which} {'has' if one else 'have'} GGML {kind}, which gguf {version} does not know; "
                         f"upgrade it (pip install -U gguf)")
        elif not dequantizable(kind):
            found.append(f"{which} {'is' if one else 'are'} {kind}, which gguf {version} cannot dequantize, so no "
                         f"node can load {'it' if one else 'them'}; requantize the file (llama-quantize)")
    return found


def check_runnable(path: Path) -> Header:
    """The header of a GGUF file a node can run, or a one-line ModelError naming the file and
    what is wrong with it."""
    header = read_header(path)
    found = problems(header)
    if found:
        raise ModelError(f"{path.name}: {'; '.join(found)}")
    return header


# --------------------------------------------------------------------------- describing it


def describe(path: Path) -> dict:
    """What ``meshnet models FILE`` shows, as plain data (``problems``: why no node can run it)."""
    header = read_header(path)
    if CHAT_TEMPLATE not in header.metadata and TOKENS in header.metadata:
        header = read_header(path, frozenset({TOKENS}))  # a template is chosen by the vocabulary
    arch = header.architecture
    layer_types = [t.type_name for t in header.tensors if _LAYER_RE.search(t.name) and len(t.shape) == 2]
    scheme, why = scheme_of(layer_types)
    return {
        "file": str(path), "bytes": header.size, "gguf_version": header.version, "architecture": arch,
        "runs": arch in RUNS, "name": header.metadata.get("general.name"),
        "layers": header.key("block_count"), "hidden_size": header.key("embedding_length"),
        "vocab_size": _vocab_size(header), "chat_template": _template(header),
        "quant_auto": {"scheme": scheme, "why": why},
        "types": _type_mix(header), "per_layer": _per_layer(header),
        "embedding": _tensor(header.find(EMBED_TENSOR)), "output": _tensor(header.find(OUTPUT_TENSOR)),
        "problems": problems(header),
    }


def _vocab_size(header: Header) -> int | None:
    tokens = header.metadata.get(TOKENS)
    if tokens is not None:
        return tokens.count if isinstance(tokens, ArrayValue) else len(tokens)
    embed = header.find(EMBED_TENSOR)
    return header.key("vocab_size") or (embed.shape[-1] if embed is not None and len(embed.shape) == 2 else None)


def _template(header: Header) -> dict:
    """The chat template a head uses: the file's, its family's (fabric.compute.templates), or none."""
    if CHAT_TEMPLATE in header.metadata:
        return {"source": "file", "name": None}
    arch = header.architecture or ""
    tokens = header.metadata.get(TOKENS)
    chosen = choose(RUNS.get(arch, arch), tokens if isinstance(tokens, list) else ())
    return {"source": "family", "name": chosen[0]} if chosen else {"source": "none", "name": None}


def _type_mix(header: Header) -> list[dict]:
    count, size = Counter(), Counter()
    for t in header.tensors:
        count[t.type_name] += 1
        size[t.type_name] += t.nbytes or 0
    return [{"type": kind, "tensors": count[kind], "bytes": size[kind]} for kind in sorted(count, key=size.get,
                                                                                           reverse=True)]


def _per_layer(header: Header) -> list[dict]:
    size, types = Counter(), defaultdict(set)
    for t in header.tensors:
        if m := _LAYER_RE.search(t.name):
            size[int(m.group(1))] += t.nbytes or 0
            types[int(m.group(1))].add(t.type_name)
    return [{"layer": i, "bytes": size[i], "types": sorted(types[i])} for i in sorted(size)]


def _tensor(t: TensorEntry | None) -> dict | None:
    return None if t is None else {"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.nbytes}


# --------------------------------------------------------------------------- text


def format_description(info: dict) -> str:
    lines = [f"{info['file']}  ({info['bytes']:,} bytes, GGUF v{info['gguf_version']})", ""]
    rows = [("architecture", f"{info['architecture']}" + ("" if info["runs"] else " (meshnet does not run it)")),
            ("name", info["name"] or "-"), ("layers", info["layers"]), ("hidden size", info["hidden_size"]),
            ("vocabulary", info["vocab_size"]), ("chat template", _template_text(info["chat_template"])),
            ("--quant auto", f"{info['quant_auto']['scheme'] or 'none'} ({info['quant_auto']['why']})")]
    lines += [f"{k:<14} {'-' if v is None else v}" for k, v in rows]
    lines += ["", f"{'TYPE':<10} {'TENSORS':>8} {'BYTES':>16}"]
    lines += [f"{t['type']:<10} {t['tensors']:>8} {t['bytes']:>16,}" for t in info["types"]]
    lines += ["", f"{'LAYER':<10} {'BYTES':>16}  TYPES"]
    lines += [f"{r['layer']:<10} {r['bytes']:>16,}  {', '.join(r['types'])}" for r in info["per_layer"]]
    lines += ["", _tensor_text("embedding", info["embedding"]),
              _tensor_text("output", info["output"]) if info["output"] else "output     tied to the embedding"]
    return "\n".join(lines)


def _template_text(template: dict) -> str:
    if template["source"] == "file":
        return "in the file"
    if template["source"] == "family":
        return f"none in the file: the {template['name']} template (its family's, as llama.cpp formats it)"
    return "none, and none known for its family: chats are refused, raw prompts (/v1/completions) work"


def _tensor_text(label: str, t: dict | None) -> str:
    if t is None:
        return f"{label:<10} none"
    shape = " x ".join(str(d) for d in t["shape"])
    size = "-" if t["bytes"] is None else f"{t['bytes']:,} bytes"
    return f"{label:<10} {t['name']}  {t['type']}  {shape}  {size}"


def _error_line(message: str) -> None:
    """One line of stderr, as every meshnet command refuses (fabric.flags; compute stays below the CLI)."""
    print(f"meshnet: error: {message}", file=sys.stderr, flush=True)


def cmd_file(ref: str, as_json: bool) -> int:
    """``meshnet models FILE``: print what the GGUF file (or alias) holds; status 1 where no
    node can run it (one error line says why), 2 where it is no GGUF reference."""
    try:
        source = resolve(ref)
    except ModelError as exc:
        _error_line(str(exc))
        return 2
    if source.kind != "gguf":
        _error_line(f"{ref} is a Hugging Face directory; `meshnet models FILE` reads .gguf files")
        return 2
    try:
        info = describe(source.path)
    except ModelError as exc:
        _error_line(str(exc))
        return 1
    print(json.dumps(info, indent=2) if as_json else format_description(info))
    if info["problems"]:
        _error_line(f"{source.path.name}: {'; '.join(info['problems'])}")
        return 1
    return 0


def check_reference(ref: str) -> None:
    """ModelError, in one line, where a model reference (an alias, a path, a pulled repository)
    names nothing or a GGUF file no node can run (:func:`check_runnable`)."""
    source = resolve(ref)
    if source.kind == "gguf":
        check_runnable(source.path)
