"""Read a shard's tensors out of a GGUF file, a layer at a time.

Only the shard's tensors are read (``pread``, see :class:`GGUFTensors`), and each decoder layer is
dequantized, named and reordered (transformers' own name map and tensor processors, which
undo llama.cpp's Q/K permutation), loaded, and put on its kernels before the next layer is
read. So a node never holds more than one layer in float32, whatever the file's size.

Where a tensor's GGUF type has a grid of its own (``fabric.compute.gguf_grid``), the loader
keeps it: each layer's linears go onto the kernel that holds their type
(``fabric.compute.quant``). The lm_head is built from the file's rows in slices, and the
token embedding of a head stays in the file (:class:`GGUFEmbedding`), dequantizing just the
rows it looks up.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..wire.shard import Shard
from .gguf_grid import FileGrid, placement_of
from .model_ref import _LAYER_RE, ModelError

log = logging.getLogger(__name__)

TENSOR_INDEX = "gguf-tensors.json"  # the tensor table, cached beside the parsed metadata
EMBED_TENSOR = "token_embd.weight"  # the token embedding's name in a GGUF file
OUTPUT_TENSOR = "output.weight"  # the lm_head's, where it is not tied to the embedding
ROWS_PER_SLICE = 4096  # rows of the lm_head dequantized at a time

# transformers model_type -> llama.cpp architecture name, where they differ
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mistral": "llama", "gemma3_text": "gemma3"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: int  # GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file
    dtype: str  # numpy dtype of the raw data (uint8 for quantized blocks)
    shape: tuple[int, ...]  # numpy shape of the raw data, as GGUFReader gives it

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensor_type).name

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def tensor_index(path: Path) -> list[dict]:
    """Tensor table of a GGUF file, each entry as gguf-py's GGUFReader gives it (its data's
    dtype and shape: the elements of a float or integer type, the bytes of a quantized one),
    read by ``gguf_info.read_header``: the reader parses every metadata field into arrays,
    10 s or more for a 49k-token vocabulary on a slow CPU."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    from .gguf_info import read_header

    out, seen = [], set()
    for t in read_header(path).tensors:
        if t.name in seen or t.nbytes is None:
            why = f"a second tensor named {t.name}" if t.name in seen else f"{t.name} has unknown {t.type_name}"
            raise ModelError(f"{path.name}: cannot read its tensor table ({why}); the file may be damaged")
        seen.add(t.name)
        qtype, dims = GGMLQuantizationType(t.type_id), tuple(reversed(t.shape))
        whole = _ELEMENTS.get(qtype.name)
        dtype, shape = (np.dtype(whole).newbyteorder("<"), dims) if whole else (np.dtype(np.uint8),
                                                                               quant_shape_to_byte_shape(dims, qtype))
        out.append(dataclasses.asdict(GGUFTensorInfo(t.name, t.type_id, t.offset, dtype.str, tuple(shape))))
    return out


_ELEMENTS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}  # types whose data GGUFReader gives as elements, not bytes


@dataclass
class GGUFTensors:
    """A GGUF file's tensor table, and its tensors' bytes read on demand.

    Bytes are read with ``pread`` into buffers of this process, not through a map of the
    file: a map would count every page read in the node's resident memory until it closed,
    so a node's peak while loading would hold the file's share twice (its pages, then the
    weights made of them)."""

    path: Path
    infos: list[GGUFTensorInfo]
    fd: int  # the file, open for reading

    @classmethod
    def open(cls, path: Path, index: Path | None = None) -> GGUFTensors:
        raw = json.loads(index.read_text()) if index is not None and index.is_file() else tensor_index(path)
        infos = [GGUFTensorInfo(**{**r, "shape": tuple(r["shape"])}) for r in raw]
        size = path.stat().st_size
        short = [t.name for t in infos if t.offset + t.nbytes > size]
        if short:
            raise ModelError(f"{path.name} is truncated: it ends before the data of {short[0]} "
                             f"({len(short)} tensors missing); download it again")
        return cls(path, infos, os.open(path, os.O_RDONLY))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def find(self, name: str) -> GGUFTensorInfo | None:
        return next((t for t in self.infos if t.name == name), None)

    def raw(self, info: GGUFTensorInfo, rows: slice = slice(None)) -> np.ndarray:
        """The tensor's bytes as the file stores them (its first axis cut to ``rows``)."""
        first, stop, _ = rows.indices(info.shape[0])
        row_bytes = info.nbytes // info.shape[0]
        out = np.empty((max(stop - first, 0), *info.shape[1:]), dtype=info.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        at, offset = 0, info.offset + first * row_bytes
        while at < len(view):
            n = os.preadv(self.fd, [view[at:]], offset + at)
            if n <= 0:
                raise ModelError(f"{self.path.name} ended while reading {info.name}; the file may be truncated")
            at += n
        return out

    def rows_of(self, info: GGUFTensorInfo, ids: np.ndarray) -> np.ndarray:
        """The raw rows ``ids`` of tensor ``info``, each read with its own ``pread`` (a head's
        embedding: the rows a step looks up, and no more of the file in this process)."""
        row_bytes = info.nbytes // info.shape[0]
        out = np.empty((len(ids), *info.shape[1:]), dtype=info.dtype)
        flat = out.reshape(len(ids), -1).view(np.uint8)  # (ids, row_bytes)
        for i, row in enumerate(ids.tolist()):
            if not 0 <= row < info.shape[0]:
                raise IndexError(f"row {row} of {info.name}, which has {info.shape[0]}")
            if os.preadv(self.fd, [flat[i]], info.offset + row * row_bytes) != row_bytes:
                raise ModelError(f"{self.path.name} ended while reading {info.name}; the file may be truncated")
        return out


def dequantize(raw: np.ndarray, tensor_type: int) -> np.ndarray:
    """float32 of raw GGUF data of ``tensor_type`` (one tensor or some of its rows)."""
    from gguf import GGMLQuantizationType, quants

    try:
        return quants.dequantize(raw, GGMLQuantizationType(tensor_type))
    except NotImplementedError:
        raise ModelError(f"GGUF type {GGMLQuantizationType(tensor_type).name} cannot be read by this gguf "
                         f"package; upgrade it (pip install -U gguf)") from None


def wanted(name: str, shard: Shard, tied: bool) -> bool:
    """Is checkpoint tensor ``name`` (HF or GGUF naming) part of this shard?"""
    m = _LAYER_RE.search(name)
    if m:
        return shard.start <= int(m.group(1)) <= shard.end
    if "embed_tokens" in name or name.startswith("token_embd"):
        return shard.is_first or (shard.is_last and tied)
    return shard.is_last  # final norm, lm_head / output


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


class Converter:
    """transformers' view of a GGUF file's tensors for one model: the tensor name map and the
    family's tensor processor (which reorders llama.cpp's Q/K rows, or shifts Gemma's norms)."""

    def __init__(self, model: nn.Module, config):
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.config = config
        arch = GGUF_ARCH.get(config.model_type, config.model_type)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        # The library recurses into every submodule, rebuilding its name table each time
        # (seconds); one flat pass over the full model's parameter names maps the same.
        keys = model.state_dict()
        flat = SimpleNamespace(config=config, state_dict=lambda: keys, named_children=lambda: [])
        self.name_map = get_gguf_hf_weights_map(flat, self.processor, model_type=arch)

    def state(self, tensors: GGUFTensors, infos: list[GGUFTensorInfo], scheme: str | None) -> tuple[dict, dict]:
        """(state, placement) of ``infos``: float32 torch tensors named as the model names them
        (MoE processors fuse experts into it), and under ``scheme`` each linear's place on the
        kernels (:func:`fabric.compute.gguf_grid.placement_of`), by parameter name."""
        state: dict = {}
        placement: dict[str, FileGrid | str] = {}
        parsed = {"config": self.config.to_dict(), "tensors": state}
        for t in infos:
            data = tensors.raw(t)
            result = self.processor.process(weights=dequantize(data, t.tensor_type), name=t.name,
                                            tensor_key_mapping=self.name_map, parsed_parameters=parsed)
            if result.name not in self.name_map:
                continue  # fused into ``state`` by the processor, or not a parameter of this model
            weight = np.array(result.weights)
            name = self.name_map[result.name]
            state[name] = torch.from_numpy(weight)
            if scheme is not None:
                place = placement_of(weight, data, t.type_name, scheme,
                                     lambda a, n=t.name: self._processed(a, n))
                if place is not None:
                    placement[name] = place
        return state, placement

    def _processed(self, array: np.ndarray, name: str) -> np.ndarray | None:
        """``array`` (shaped as GGUF tensor ``name`` dequantized) as the processor hands that
        tensor to the model (rows reordered where llama.cpp permuted them)."""
        scratch = {"config": self.config.to_dict(), "tensors": {}}
        result = self.processor.process(weights=array, name=name, tensor_key_mapping=self.name_map,
                                        parsed_parameters=scratch)
        return None if result.weights is None else np.asarray(result.weights)


def groups(infos: list[GGUFTensorInfo], shard: Shard, tied: bool,
           skip: set[str]) -> Iterator[tuple[int | None, list[GGUFTensorInfo]]]:
    """The shard's tensors, a group at a time: those outside the layers (None), then each layer's."""
    chosen = [t for t in infos if wanted(t.name, shard, tied) and t.name not in skip]
    yield None, [t for t in chosen if layer_of(t.name) is None]
    for i in range(shard.start, shard.end + 1):
        yield i, [t for t in chosen if layer_of(t.name) == i]


def head_rows(tensors: GGUFTensors, info: GGUFTensorInfo, scheme: str) -> nn.Module:
    """The int8 lm_head of tensor ``info`` (vocab, hidden), as every scheme holds it
    (``fabric.compute.quant.LM_HEAD_SCHEME``), built ROWS_PER_SLICE rows at a time so that the
    float32 copy never exists whole: each row's scale is its own, so slices give what the
    whole would. On the q8dot kernel where ``scheme`` puts the file's layers there."""
    from .quant import Int8Linear, file_on_dot, on_dot_kernel, quantize_weight

    vocab = info.shape[0]
    weight = scales = None
    for at in range(0, vocab, ROWS_PER_SLICE):
        raw = tensors.raw(info, slice(at, at + ROWS_PER_SLICE))
        block = torch.from_numpy(dequantize(raw, info.tensor_type))  # (rows, hidden)
        block = block.to(torch.bfloat16)  # as a bfloat16 model holds it, before int8
        if weight is None:
            weight = torch.empty((vocab, block.shape[1]), dtype=torch.int8)
            scales = torch.empty(vocab, dtype=torch.bfloat16)
        weight[at:at + len(block)], scales[at:at + len(block)] = quantize_weight(block)
    head = Int8Linear(weight, scales)
    return on_dot_kernel(head) if file_on_dot(scheme) else head


KEPT_ROW_BYTES = 4 << 20  # dequantized embedding rows a head keeps (GGUFEmbedding)


class GGUFEmbedding(nn.Module):
    """A token embedding left in the GGUF file, its quantized rows read as they are looked up
    and dequantized. The rows equal those of the whole dequantized matrix bit for bit
    (llama.cpp's blocks never span two rows), so a head holds a few looked-up rows instead of
    vocab x hidden floats (SmolLM2-135M: 108 MiB). ``scale`` multiplies them as the family's
    own embedding does (Gemma: sqrt(hidden), in the model's dtype).

    The rows are read with ``pread``, not through a map of the file: every page a map touches
    stays in the process's resident memory, and the kernel maps the pages around each one
    looked up too (read-around), so a 64-token generation of random tokens had mapped 32 MiB of
    a 79 MiB embedding (the 1.7B shape in ``bench/models.py``).

    A row read and dequantized is kept, the latest KEPT_ROW_BYTES of them: a stream's tokens
    repeat, and a lookup of kept rows costs a fifth of a read (70 µs for one to four rows)."""

    def __init__(self, tensors: GGUFTensors, info: GGUFTensorInfo, hidden: int, scale: float | None = None):
        super().__init__()
        self.tensors, self.info, self.tensor_type = tensors, info, info.tensor_type
        self.hidden, self.scale = hidden, scale
        self.device, self.dtype = torch.device("cpu"), torch.float32  # as ``to`` sets them
        self._kept: dict[int, np.ndarray] = {}  # token id -> its float32 row, oldest first
        self._kept_bytes = 0

    @classmethod
    def from_tensors(cls, tensors: GGUFTensors, model, config) -> GGUFEmbedding | None:
        """The lazy embedding of a GGUF file, or None where the plain one must load: an
        embedding module that is not a lookup (scaled or not), or whose rows are not one
        row of blocks per token."""
        module = model.model.embed_tokens
        scale = getattr(module, "scalar_embed_scale", None)
        if not isinstance(module, nn.Embedding) or (type(module) is not nn.Embedding and scale is None):
            return None
        info = tensors.find(EMBED_TENSOR)
        if info is None:
            return None
        own = GGUFTensors(tensors.path, [info], os.open(tensors.path, os.O_RDONLY))  # its own handle: kept open
        embed = cls(own, info, config.hidden_size, scale)
        probe = min(4, info.shape[0])
        if embed.rows(np.arange(probe)).shape != (probe, config.hidden_size):
            own.close()
            return None  # not one row of blocks per token: load it whole
        return embed

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 rows ``ids`` (n,) -> (n, hidden): kept rows as kept, the others read from the
        file (each distinct one once) and kept."""
        wanted = ids.tolist()
        found = {i: self._kept.get(i) for i in wanted}
        missing = [i for i, row in found.items() if row is None]
        if missing:
            read = dequantize(self.tensors.rows_of(self.info, np.array(missing, dtype=np.int64)), self.tensor_type)
            for i, row in zip(missing, read.reshape(len(missing), -1)):
                found[i] = self._keep(i, row.copy())
        return np.stack([found[i] for i in wanted])

    def _keep(self, i: int, row: np.ndarray) -> np.ndarray:
        while self._kept and self._kept_bytes + row.nbytes > KEPT_ROW_BYTES:
            self._kept_bytes -= self._kept.pop(next(iter(self._kept))).nbytes  # the oldest goes
        self._kept[i] = row
        self._kept_bytes += row.nbytes
        return row

    def to(self, *args, **kwargs):
        """As ``nn.Module.to``: the rows looked up come out on this device and in this dtype."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)  # the parser nn.Module.to uses
        self.device, self.dtype = device or self.device, dtype or self.dtype
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        weights = torch.from_numpy(np.array(self.rows(flat), dtype=np.float32))
        out = weights.reshape(*ids.shape, self.hidden).to(device=self.device, dtype=self.dtype)
        if self.scale is not None:  # as Gemma's scaled embedding: its scale in the weights' dtype
            out = out * torch.tensor(self.scale, dtype=torch.float32).to(self.dtype)
        return out
