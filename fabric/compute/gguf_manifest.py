"""A GGUF file's manifest: what a node that fetches some of its layers from peers checks
every byte against, and what the model's fingerprint is made of.

The manifest lists the file's metadata section (the GGUF key/value pairs: config, tokenizer,
chat template) by its length and BLAKE3 digest, and every tensor by name, GGML type, shape,
byte offset (from the start of the data section), byte length and BLAKE3 digest. Its own
digest is the sha256 of its canonical JSON. A GGUF model's fingerprint is made of that digest
alone (:func:`fingerprint_of`), so a node holding the whole file and a node holding a partial
copy of it (``fabric.compute.gguf_partial``: it carries the source's manifest in its metadata)
register the same fingerprint and chain.

Why BLAKE3 for the bytes: a fetch hashes every byte it receives, on the cores that also copy
them from the socket and into the page cache, and on two cores the hash set the pace. BLAKE3
(256 bits; like sha256, no known way to make other bytes with the same digest) takes about
0.3 ns a byte on one AVX2 core against sha256's 0.64-0.89 with SHA-NI, and uses every core
where a whole file is hashed. Format 1 of the manifest named sha256; a copy made under it is
never loaded, and its layers are fetched again.

Hashing a whole file takes a while (about a quarter of a second a GiB on two cores): the
manifest is computed once and kept in the cache beside the parsed metadata, keyed by the
file's path, size and mtime.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import blake3

from ..wire.shard import Shard
from .gguf_info import read_header
from .model_ref import _LAYER_RE, _STRING, ModelError, _skip_value

log = logging.getLogger(__name__)

FORMAT = "meshnet-gguf-manifest/2"
OLD_FORMATS = ("meshnet-gguf-manifest/1",)  # sha256 for each item: read only to say the copy is outdated
KV_START = 24  # magic, version, tensor count, key/value count: the key/value pairs start here
MANIFEST_KEY = "meshnet.partial.manifest"  # a partial file's metadata: its source's manifest (JSON)
LAYERS_KEY = "meshnet.partial.layers"  # a partial file's metadata: the layers it holds ("A-B")
MODEL_KEY = "meshnet.partial.model_id"  # a partial file's metadata: the model id the swarm lists
EMBED_TENSOR, OUTPUT_TENSOR = "token_embd.weight", "output.weight"
KV_NAME = "@kv"  # the metadata section, as a chunk request names it
HASH_BLOCK = 8 << 20  # bytes read at a time while hashing
MAX_TENSORS = 1 << 16  # tensors a manifest may list
MAX_NAME = 256  # characters of a tensor name (llama.cpp's limit is 64)


class OutdatedManifest(ModelError):
    """A manifest of an older format: its copy must be fetched again."""


@dataclass(frozen=True)
class TensorRecord:
    name: str
    type_id: int  # GGML type number
    shape: tuple[int, ...]  # as GGUF writes it: the row length first
    offset: int  # from the start of the source file's data section
    nbytes: int
    blake3: str

    @property
    def layer(self) -> int | None:
        m = _LAYER_RE.search(self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class FileManifest:
    version: int  # GGUF version of the source file
    alignment: int  # general.alignment of the source file
    num_layers: int  # its block_count
    kv_count: int  # key/value pairs in its metadata section
    kv_bytes: int  # that section's length
    kv_blake3: str
    tensors: tuple[TensorRecord, ...]

    def to_json(self) -> dict:
        fields = {"version": self.version, "alignment": self.alignment, "num_layers": self.num_layers,
                  "kv_count": self.kv_count, "kv_bytes": self.kv_bytes, "kv_blake3": self.kv_blake3}
        tensors = [{"name": t.name, "type_id": t.type_id, "shape": list(t.shape), "offset": t.offset,
                    "nbytes": t.nbytes, "blake3": t.blake3} for t in self.tensors]  # asdict deep-copies: 10x slower
        return {"format": FORMAT, **fields, "tensors": tensors}

    def canonical(self) -> bytes:
        return self._canonical

    @cached_property
    def _canonical(self) -> bytes:  # made once: a fetch asks for the digest with every chunk
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    @cached_property
    def tied(self) -> bool:
        """No output tensor: the lm_head is the token embedding."""
        return all(t.name != OUTPUT_TENSOR for t in self.tensors)

    def find(self, name: str) -> TensorRecord | None:
        return next((t for t in self.tensors if t.name == name), None)

    def needed(self, shard: Shard) -> list[TensorRecord]:
        """The tensors a node serving ``shard`` loads (``fabric.compute.gguf_load.wanted``)."""
        return [t for t in self.tensors if wanted(t.name, shard, self.tied)]

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + sum(t.nbytes for t in self.tensors)

    @classmethod
    def from_json(cls, raw: object) -> FileManifest:
        """A manifest a peer sent (or a partial file holds), every field checked; ModelError if not one."""
        try:
            return _parse_manifest(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"not a valid manifest ({type(exc).__name__}: {exc})") from None


def wanted(name: str, shard: Shard, tied: bool) -> bool:
    """Is GGUF tensor ``name`` one a node serving ``shard`` loads? (As ``gguf_load.wanted``,
    without importing torch.)"""
    m = _LAYER_RE.search(name)
    if m:
        return shard.start <= int(m.group(1)) <= shard.end
    if name.startswith("token_embd"):
        return shard.is_first or (shard.is_last and tied)
    return shard.is_last


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def _parse_manifest(raw: object) -> FileManifest:
    _check(isinstance(raw, dict), "not a JSON object")
    if raw.get("format") in OLD_FORMATS:
        raise OutdatedManifest(f"its format is {raw['format']}, made by an older meshnet, not {FORMAT}")
    _check(raw.get("format") == FORMAT, f"format is not {FORMAT}")
    ints = {k: raw[k] for k in ("version", "alignment", "num_layers", "kv_count", "kv_bytes")}
    _check(all(type(v) is int and 0 <= v < 1 << 40 for v in ints.values()), "a count is not a small int")
    _check(ints["alignment"] > 0 and 0 < ints["num_layers"] <= 4096, "alignment or num_layers out of range")
    _check(_is_digest(raw["kv_blake3"]), "kv_blake3 is not a BLAKE3 digest")
    tensors = raw["tensors"]
    _check(isinstance(tensors, list) and 0 < len(tensors) <= MAX_TENSORS, "tensors is not a list")
    records = tuple(_record(t) for t in tensors)
    _check(len({t.name for t in records}) == len(records), "two tensors share a name")
    return FileManifest(**ints, kv_blake3=raw["kv_blake3"], tensors=records)


def _record(t: object) -> TensorRecord:
    _check(isinstance(t, dict) and set(t) == {"name", "type_id", "shape", "offset", "nbytes", "blake3"},
           "a tensor record has other fields")
    _check(isinstance(t["name"], str) and 0 < len(t["name"]) <= MAX_NAME and t["name"] != KV_NAME,
           "a tensor name is empty or too long")
    _check(isinstance(t["shape"], list) and 1 <= len(t["shape"]) <= 4
           and all(type(d) is int and 0 < d < 1 << 40 for d in t["shape"]), f"{t['name']}: bad shape")
    _check(all(type(t[k]) is int and 0 <= t[k] < 1 << 48 for k in ("type_id", "offset", "nbytes")),
           f"{t['name']}: bad type, offset or length")
    _check(_is_digest(t["blake3"]), f"{t['name']}: blake3 is not a BLAKE3 digest")
    return TensorRecord(t["name"], t["type_id"], tuple(t["shape"]), t["offset"], t["nbytes"], t["blake3"])


_DIGEST = re.compile(r"[0-9a-f]{64}")


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None  # a character loop: 5 ms a manifest


def fingerprint_of(digest: str) -> str:
    """The weights' part of a GGUF model's fingerprint (``models.fingerprint`` appends the quantization)."""
    return hashlib.sha256(b"gguf-manifest:" + digest.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- reading a file


def kv_span(path: Path) -> tuple[int, int]:
    """(key/value pair count, bytes of the key/value section) of GGUF file ``path``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            n_kv = struct.unpack_from("<Q", m, 16)[0]
            at = KV_START
            for _ in range(n_kv):
                at = _skip_value(m, at, _STRING)
                at = _skip_value(m, at + 4, struct.unpack_from("<I", m, at)[0])
        except struct.error:
            raise ModelError(f"{path.name} is truncated: it ends inside its metadata") from None
    return n_kv, at - KV_START


def held_manifest(path: Path) -> FileManifest | None:
    """The source manifest a partial file carries; None for a whole file."""
    header = read_header(path)
    raw = header.metadata.get(MANIFEST_KEY)
    if raw is None:
        return None
    try:
        return FileManifest.from_json(json.loads(raw))
    except ValueError:
        raise ModelError(f"{path.name}: its {MANIFEST_KEY} is not JSON; fetch it again") from None
    except OutdatedManifest as exc:
        raise OutdatedManifest(f"{path.name} was fetched by an older meshnet ({exc}): delete it and fetch "
                               "its layers again (meshnet node --model ID --layers A-B --tracker T)") from None


def compute_manifest(path: Path, say: Callable[[str], None] | None = None) -> FileManifest:
    """Hash every tensor of whole GGUF file ``path`` (slow: ``say`` hears the progress)."""
    header = read_header(path)
    n_kv, kv_bytes = kv_span(path)
    data_start = min((t.offset for t in header.tensors), default=header.size)
    align = header.metadata.get("general.alignment", 32)
    total = sum(t.nbytes or 0 for t in header.tensors)
    records, done, shown = [], 0, -1
    fd = os.open(path, os.O_RDONLY)
    try:
        kv_digest = hash_range(fd, KV_START, kv_bytes)
        for t in header.tensors:
            if t.nbytes is None:
                raise ModelError(f"{path.name}: tensor {t.name} has a type ({t.type_name}) whose size is not known")
            records.append(TensorRecord(t.name, t.type_id, t.shape, t.offset - data_start, t.nbytes,
                                        hash_range(fd, t.offset, t.nbytes)))
            done += t.nbytes
            if say is not None and total and (pct := done * 100 // total) // 10 != shown:
                shown = pct // 10
                say(f"hashing {path.name} for its manifest: {pct}% of {total / (1 << 20):,.0f} MiB")
    finally:
        os.close(fd)
    layers = header.key("block_count")
    if not isinstance(layers, int):
        raise ModelError(f"{path.name} names no layer count (block_count)")
    return FileManifest(header.version, align, layers, n_kv, kv_bytes, kv_digest, tuple(records))


def item_hasher(every_core: bool = False):
    """A BLAKE3 hasher of one item's bytes (``every_core``: large updates split over the cores)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if every_core else 1)


def hash_range(fd: int, offset: int, length: int) -> str:
    """The BLAKE3 digest of ``length`` bytes of ``fd`` from ``offset``, hashed on every core: a
    whole file's manifest and a resumed fetch's journaled items, which nothing else runs beside
    (and, rarely, an item whose chunks came out of order, read back at its end)."""
    h = item_hasher(every_core=True)
    at = 0
    while at < length:
        block = os.pread(fd, min(HASH_BLOCK, length - at), offset + at)
        if not block:
            raise ModelError("the file ended inside a tensor; it may be truncated")
        h.update(block)
        at += len(block)
    return h.hexdigest()


def manifest_for(path: Path, cache_root: Path | None = None) -> FileManifest:
    """The manifest of GGUF file ``path``: the one a partial file carries, else the cached one,
    else computed now (and cached under ``cache_root``)."""
    held = held_manifest(path)
    if held is not None:
        return held
    cached = _cache_path(path, cache_root)
    if cached is not None and cached.is_file():
        try:
            return FileManifest.from_json(json.loads(cached.read_text()))
        except (OSError, ValueError, ModelError):
            log.info("the cached manifest %s is unreadable: hashing %s again", cached, path.name)
    log.info("hashing %s once for its manifest (cached in %s)", path.name, cached)
    manifest = compute_manifest(path, say=log.info)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(manifest.canonical())
        tmp.replace(cached)
    return manifest


def _cache_path(path: Path, cache_root: Path | None) -> Path | None:
    if cache_root is None:
        return None
    st = path.stat()
    key = hashlib.sha256(f"{FORMAT}:{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root / "gguf-manifest" / f"{path.stem}-{key}.json"


def held_layers(path: Path) -> tuple[int, int] | None:
    """The layers a partial file holds (None: a whole file, every layer)."""
    text = read_header(path).metadata.get(LAYERS_KEY)
    if not isinstance(text, str):
        return None
    a, _, b = text.partition("-")
    try:
        return int(a), int(b)
    except ValueError:
        raise ModelError(f"{path.name}: its {LAYERS_KEY} is {text!r}, not A-B") from None
