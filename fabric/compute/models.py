"""Load only one shard's weights of a model reference.

A reference is a local Hugging Face directory (config + safetensors + tokenizer), a
``.gguf`` file, or an alias of a model that a Python package ships (``smollm2-135m``);
``fabric.compute.model_ref`` resolves it without torch (its names are re-exported here).

Loading builds the architecture on the meta device with transformers' own classes, drops
the decoder layers outside the shard (and the embeddings / final norm / lm_head where the
shard does not need them), then reads only the shard's tensors and loads them with
transformers' own weight conversion (e.g. MoE expert fusion) or, for GGUF, its own name
mapping and tensor processors (which undo llama.cpp's Q/K permutation). Only the needed
GGUF tensors are dequantized; a head that does not also hold the lm_head keeps the token
embedding as the GGUF stores it and dequantizes just the rows it looks up
(:class:`GGUFEmbedding`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..wire.shard import Shard
from .gguf_grid import FileGrid, grid_of
from .model_ref import (  # noqa: F401  (re-exported: callers import model references from here too)
    _LAYER_RE,
    ALIASES,
    DEFAULT_MODEL,
    PULL_MANIFEST,
    Alias,
    ModelError,
    ModelSource,
    alias_path,
    default_cache_root,
    default_data_root,
    default_models_root,
    is_repo_id,
    pick_quant,
    pulled_path,
    resolve,
)

log = logging.getLogger(__name__)

def layer_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one decoder layer's weights take in ``dtype`` (from the architecture, no weights)."""
    from transformers import AutoModelForCausalLM

    fields = {**config.to_dict(), "num_hidden_layers": 1}
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][:1]
    one = config.__class__.from_dict(fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one)
    params = sum(t.numel() for t in model.model.layers[0].parameters())
    return params * torch.empty((), dtype=dtype).element_size()


def _metadata_dir(source: ModelSource, cache_root: Path | None) -> tuple[Path, str | None]:
    """(directory, gguf_file) to read config and tokenizer from.

    Parsing a GGUF's metadata (its tokenizer arrays) takes seconds each time, so the parsed
    config and tokenizer are saved once as plain files under ``cache_root``.
    """
    if source.kind != "gguf" or cache_root is None:
        return source.directory, source.gguf_file
    from transformers import AutoConfig, AutoTokenizer

    st = source.path.stat()
    key = hashlib.sha256(f"{source.path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root / "gguf-meta" / f"{source.path.stem}-{key}"
    if not (target / "config.json").is_file():
        log.info("parsing GGUF metadata of %s once (cached in %s)", source.path.name, target)
        tmp = Path(tempfile.mkdtemp(dir=_mkdir(target.parent)))
        AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file).save_pretrained(tmp)
        (tmp / TENSOR_INDEX).write_text(json.dumps(_gguf_tensor_index(source.path)))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target, None


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_config(source: ModelSource, cache_root: Path | None = None):
    from transformers import AutoConfig

    directory, gguf_file = _metadata_dir(source, cache_root)
    return AutoConfig.from_pretrained(directory, gguf_file=gguf_file)


def load_tokenizer(source: ModelSource, cache_root: Path | None = None):
    from transformers import AutoTokenizer

    directory, gguf_file = _metadata_dir(source, cache_root)
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


def fingerprint(source: ModelSource, config, quant: str | None = None) -> str:
    """Digest of what determines a model's outputs: its architecture config, its weights and
    the quantization a node computes with (``:int8``/``:int4`` appended to the digest).

    Two nodes chain only when this matches: same model id is not enough. The config is taken
    without local paths and runtime-only fields (:func:`architecture`); the weights by the
    pulled manifest's digests, else by each file's size and sampled contents. Nothing here
    depends on a path, a home directory, an install location, a file's mtime or the machine,
    so two machines holding the same files agree.
    """
    h = hashlib.sha256(json.dumps(architecture(config), sort_keys=True, default=str).encode())
    pinned = _pulled_digests(source)
    if pinned:  # a pulled copy, maybe of some shards only: the hub's digests of all its weight files
        h.update(json.dumps(pinned, sort_keys=True).encode())
        return h.hexdigest()[:32] + _quant_suffix(quant)
    files = [source.path] if source.kind == "gguf" else sorted(source.path.glob("*.safetensors"))
    for f in files:
        size = f.stat().st_size
        # a GGUF's own file name is local (renaming it changes no output); shard names are part of a repository
        h.update(f"{f.name if source.kind == 'hf' else 'gguf'}:{size}".encode())
        with open(f, "rb") as fh:
            for i in range(17):  # head, 16 evenly spaced samples: cheap even for 100 GB
                fh.seek(min(size, (size * i) // 16))
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:32] + _quant_suffix(quant)


def file_grids(source: ModelSource, cache_root: Path | None = None) -> dict[str, FileGrid]:
    """Every Q4_0 / Q4_1 linear's own grid in a GGUF file, by parameter name (for a
    single-process reference computing as ``load_shard(quant="int4")`` does)."""
    from transformers import AutoModelForCausalLM

    config = load_config(source, cache_root)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    grids: dict[str, FileGrid] = {}
    n = config.num_hidden_layers
    _gguf_state(_gguf_tensors(source, cache_root), model, config, Shard(0, n - 1, n),
                bool(getattr(config, "tie_word_embeddings", False)), progress=False, grids=grids)
    return grids


def _quant_suffix(quant: str | None) -> str:
    """Quantized and float weights of one model never share a route."""
    return f":{quant}" if quant and quant != "none" else ""


# Fields of a transformers config that say where or how it was loaded, not what it computes.
RUNTIME_FIELDS = frozenset({"transformers_version", "dtype", "torch_dtype", "use_cache", "return_dict",
                            "output_attentions", "output_hidden_states"})


def architecture(config) -> dict:
    """``config.to_dict()`` without local paths and runtime-only fields, sub-configs included.

    Dropped: every key that starts with ``_`` (``_name_or_path`` is the directory the config
    was read from: a cache under $HOME for a GGUF, site-packages for an alias;
    ``_commit_hash``, ``_attn_implementation`` ...) and :data:`RUNTIME_FIELDS`.
    """
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()
                    if not (isinstance(k, str) and (k.startswith("_") or k in RUNTIME_FIELDS))}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value
    return clean(config.to_dict())


def _pulled_digests(source: ModelSource) -> dict[str, str] | None:
    """{weight file: sha256} of every weight file of a pulled repository (fetched or not), so
    nodes that pulled different layers of one revision agree; None when not known."""
    manifest = source.path / PULL_MANIFEST if source.kind == "hf" else None
    if manifest is None or not manifest.is_file():
        return None
    files = json.loads(manifest.read_text()).get("files", {})
    digests = {name: f.get("sha256") for name, f in files.items() if name.endswith(".safetensors")}
    return digests if digests and all(digests.values()) else None


# --------------------------------------------------------------------------- shard loading


@dataclass
class ShardWeights:
    """The modules a node needs for its shard, loaded and ready to run."""

    config: object
    shard: Shard
    embed: nn.Module | None  # present when the shard holds layer 0
    layers: dict[int, nn.Module]  # global layer index -> decoder layer
    norm: nn.Module | None  # final norm, when the shard holds the last layer
    lm_head: nn.Module | None
    rotary: nn.Module
    dtype: torch.dtype
    device: torch.device

    def parameter_bytes(self) -> int:
        mods = [m for m in (self.embed, self.norm, self.lm_head, *self.layers.values()) if m is not None]
        seen = {p.data_ptr(): p.numel() * p.element_size() for m in mods for p in m.parameters()}
        return sum(seen.values())


class _Absent(nn.Module):
    """Stands in for a decoder layer this node does not hold."""


def check_device(device: str, quant: str | None = None) -> None:
    """Raise ModelError unless layers can compute on ``device`` here (quantized by ``quant``)."""
    if quant not in (None, "none") and torch.device(device).type != "cpu":
        raise ModelError(f"--quant {quant} runs on the CPU kernels of torch; use --device cpu, or no --quant")
    if torch.device(device).type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ModelError(f"--device {device}: no CUDA device is available here (torch {torch.__version__}"
                         f"{'' if torch.version.cuda else ', a build without CUDA'})")
    index, count = torch.device(device).index, torch.cuda.device_count()
    if index is not None and index >= count:
        raise ModelError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def load_shard(source: ModelSource, shard: Shard, *, dtype: torch.dtype = torch.float32,
               device: str = "cpu", progress: bool = True, cache_root: Path | None = None,
               quant: str | None = None) -> ShardWeights:
    """Load only ``shard``'s weights of ``source`` onto ``device`` in ``dtype``.

    ``quant="int8"`` or ``"int4"`` (see ``fabric.compute.quant``; CPU only) loads in bfloat16 whatever
    ``dtype`` says, then quantizes the decoder layers' linears and the lm_head, one by one.
    """
    from transformers import AutoModelForCausalLM

    check_device(device, quant)
    if quant in (None, "none"):
        quant = None
    elif dtype != torch.bfloat16:
        log.info("--quant %s computes in bfloat16: loading in bfloat16, not %s", quant, dtype)
        dtype = torch.bfloat16

    config = load_config(source, cache_root)
    if config.num_hidden_layers != shard.num_layers:
        raise ModelError(f"model has {config.num_hidden_layers} layers, shard expects {shard.num_layers}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    lazy_embed, grids = None, {} if quant == "int4" else None  # int4: a Q4_0 / Q4_1 file's linears keep their grid
    if source.kind == "gguf":
        tensors = _gguf_tensors(source, cache_root)
        if shard.is_first and not shard.is_last:
            lazy_embed = GGUFEmbedding.from_tensors(*tensors, model, config)
        state = _gguf_state(tensors, model, config, shard, tied, progress, skip_embed=lazy_embed is not None,
                            grids=grids)
    else:
        state = _safetensors_state(source, shard, tied)
    _prune(model, shard, keep_embed=(shard.is_first and lazy_embed is None) or (shard.is_last and tied))
    _load_into(model, state, dtype)
    weights = _shard_weights(model, shard, lazy_embed, tied, dtype, device)
    if quant is not None:  # --quant: see fabric/compute/quant.py
        from .quant import quantize

        on_grid = grid_modules(model, grids or {})
        del state, model, grids  # the float checkpoint tensors, before quantizing
        quantize(weights, quant, on_grid)
    return weights


def grid_modules(model: nn.Module, grids: dict[str, FileGrid]) -> dict[nn.Module, FileGrid]:
    """{linear: its file grid} for ``grids`` named by parameter (``model.layers.0.mlp.up_proj.weight``)."""
    found = {}
    for name, grid in grids.items():
        try:
            module = model.get_submodule(name.removesuffix(".weight"))
        except AttributeError:
            continue
        if isinstance(module, nn.Linear) and tuple(module.weight.shape) == tuple(grid.codes.shape):
            found[module] = grid
    return found


def _shard_weights(model, shard: Shard, lazy_embed, tied: bool, dtype: torch.dtype, device: str) -> ShardWeights:
    """The shard's modules of a loaded ``model``, on ``device`` in ``dtype``."""
    inner, config = model.model, model.config
    if lazy_embed is not None:
        inner.embed_tokens = lazy_embed
    lm_head = None
    if shard.is_last:
        lm_head = model.lm_head
        if tied:
            lm_head.weight = inner.embed_tokens.weight
    rotary = type(inner.rotary_emb)(config=config)  # buffers were on meta: rebuild for real
    weights = ShardWeights(
        config=config, shard=shard,
        embed=inner.embed_tokens if shard.is_first else None,
        layers={i: inner.layers[i] for i in range(shard.start, shard.end + 1)},
        norm=inner.norm if shard.is_last else None, lm_head=lm_head,
        rotary=rotary, dtype=dtype, device=torch.device(device),
    )
    for module in (weights.embed, weights.norm, weights.lm_head, *weights.layers.values()):
        if module is not None:
            module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    weights.rotary.to(device=device)
    _check_materialized(weights)
    return weights


def _prune(model, shard: Shard, keep_embed: bool) -> None:
    inner = model.model
    for i in range(shard.num_layers):
        if not shard.start <= i <= shard.end:
            inner.layers[i] = _Absent()
    if not keep_embed:
        inner.embed_tokens = None
    if not shard.is_last:
        inner.norm = None
        model.lm_head = None


def _wanted(name: str, shard: Shard, tied: bool) -> bool:
    """Is checkpoint tensor ``name`` (HF or GGUF naming) part of this shard?"""
    m = _LAYER_RE.search(name)
    if m:
        return shard.start <= int(m.group(1)) <= shard.end
    if "embed_tokens" in name or name.startswith("token_embd"):
        return shard.is_first or (shard.is_last and tied)
    return shard.is_last  # final norm, lm_head / output


def _safetensors_state(source: ModelSource, shard: Shard, tied: bool) -> dict:
    from safetensors import safe_open

    state = {}
    for f in sorted(source.path.glob("*.safetensors")):
        handle = safe_open(str(f), framework="pt")  # memory-mapped; slices read lazily
        for key in handle.keys():
            if _wanted(key, shard, tied):
                state[key] = handle.get_slice(key)
    return state


TENSOR_INDEX = "gguf-tensors.json"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: int  # GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file
    dtype: str  # numpy dtype of the raw data (uint8 for quantized blocks)
    shape: tuple[int, ...]  # numpy shape of the raw data, as GGUFReader gives it


def _gguf_tensor_index(path: Path) -> list[dict]:
    """Tensor table of a GGUF file (GGUFReader parses every metadata field: seconds)."""
    from gguf import GGUFReader

    return [dataclasses.asdict(GGUFTensorInfo(t.name, int(t.tensor_type), int(t.data_offset),
                                              t.data.dtype.str, tuple(t.data.shape)))
            for t in GGUFReader(str(path)).tensors]


def _gguf_tensors(source: ModelSource, cache_root: Path | None) -> tuple[list[GGUFTensorInfo], np.ndarray]:
    directory, _ = _metadata_dir(source, cache_root)
    index = directory / TENSOR_INDEX
    raw = json.loads(index.read_text()) if index.is_file() else _gguf_tensor_index(source.path)
    infos = [GGUFTensorInfo(**{**r, "shape": tuple(r["shape"])}) for r in raw]
    return infos, np.memmap(source.path, dtype=np.uint8, mode="r")


def _gguf_state(tensors: tuple[list[GGUFTensorInfo], np.ndarray], model, config, shard: Shard, tied: bool,
                progress: bool, skip_embed: bool = False, grids: dict[str, FileGrid] | None = None) -> dict:
    """The shard's tensors of a GGUF file, dequantized to float32 and named as the model names
    them; with ``grids``, also each Q4_0 / Q4_1 linear's own grid, by the same names."""
    from gguf import GGMLQuantizationType, dequantize
    from tqdm import tqdm
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    infos, mm = tensors
    arch = GGUF_ARCH.get(config.model_type, config.model_type)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    # The library recurses into every submodule, rebuilding its name table each time
    # (seconds); one flat pass over the full model's parameter names maps the same.
    keys = model.state_dict()
    flat = SimpleNamespace(config=config, state_dict=lambda: keys, named_children=lambda: [])
    name_map = get_gguf_hf_weights_map(flat, processor)
    state: dict = {}
    parsed = {"config": config.to_dict(), "tensors": state}  # MoE processors write fused experts here
    wanted = [t for t in infos if _wanted(t.name, shard, tied) and not (skip_embed and t.name == EMBED_TENSOR)]
    for t in tqdm(wanted, desc=f"loading layers {shard}", unit="tensor", disable=not progress):
        data = np.frombuffer(mm, dtype=t.dtype, count=math.prod(t.shape), offset=t.offset).reshape(t.shape)
        kind = GGMLQuantizationType(t.tensor_type)
        result = processor.process(weights=dequantize(data, kind), name=t.name,
                                   tensor_key_mapping=name_map, parsed_parameters=parsed)
        if result.name not in name_map:
            continue
        weight = np.array(result.weights)
        state[name_map[result.name]] = torch.from_numpy(weight)
        if grids is not None:  # --quant int4 on a Q4_0 / Q4_1 file: keep the file's codes, steps and minima
            grid = grid_of(weight, data, kind.name, lambda a, name=t.name: _processed(processor, a, name, name_map,
                                                                                      config))
            if grid is not None:
                grids[name_map[result.name]] = grid
    return state


def _processed(processor, array: np.ndarray, name: str, name_map: dict, config) -> np.ndarray | None:
    """``array`` (shaped as GGUF tensor ``name`` dequantized) as transformers' processor
    hands that tensor to the model (rows reordered where llama.cpp permuted them)."""
    scratch = {"config": config.to_dict(), "tensors": {}}
    result = processor.process(weights=array, name=name, tensor_key_mapping=name_map, parsed_parameters=scratch)
    return None if result.weights is None else np.asarray(result.weights)


EMBED_TENSOR = "token_embd.weight"  # the token embedding's name in a GGUF file


class GGUFEmbedding(nn.Module):
    """A token embedding kept as the GGUF file stores it (memory-mapped, quantized blocks),
    dequantizing only the rows looked up. The rows equal those of the whole dequantized
    matrix bit for bit (llama.cpp's blocks never span two rows), so a head holds a few
    looked-up rows instead of vocab x hidden floats (SmolLM2-135M: 108 MiB)."""

    def __init__(self, raw: np.ndarray, tensor_type: int, hidden: int):
        super().__init__()
        self.raw, self.tensor_type, self.hidden = raw, tensor_type, hidden
        self.device, self.dtype = torch.device("cpu"), torch.float32  # as ``to`` sets them

    @classmethod
    def from_tensors(cls, infos: list[GGUFTensorInfo], mm: np.ndarray, model, config) -> "GGUFEmbedding | None":
        """The lazy embedding of a GGUF file's tensors (``_gguf_tensors``), or None where the
        plain one must load: a model whose embedding module is not a plain lookup, or whose
        embedding is not one row of blocks per token."""
        if type(model.model.embed_tokens) is not nn.Embedding:
            return None
        info = next((t for t in infos if t.name == EMBED_TENSOR), None)
        if info is None:
            return None
        # a map of its own bytes alone: the file's map (and the layer pages read through it) goes after loading
        raw = np.memmap(mm.filename, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)
        embed = cls(raw, info.tensor_type, config.hidden_size)
        if embed.rows(np.arange(min(4, raw.shape[0]))).shape != (min(4, raw.shape[0]), config.hidden_size):
            return None  # not one row of blocks per token: load it whole
        return embed

    def rows(self, ids: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, dequantize

        return dequantize(np.ascontiguousarray(self.raw[ids]), GGMLQuantizationType(self.tensor_type))

    def to(self, *args, **kwargs):
        """As ``nn.Module.to``: the rows looked up come out on this device and in this dtype."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)  # the parser nn.Module.to uses
        self.device, self.dtype = device or self.device, dtype or self.dtype
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        weights = torch.from_numpy(np.array(self.rows(flat), dtype=np.float32))
        return weights.reshape(*ids.shape, self.hidden).to(device=self.device, dtype=self.dtype)


# transformers model_type -> llama.cpp architecture name, where they differ
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mistral": "llama"}


def _load_into(model, state: dict, dtype: torch.dtype) -> None:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=dtype)
    info, _ = convert_and_load_state_dict_in_model(model, state, config)
    if info.conversion_errors:
        raise ModelError(f"could not convert weights: {info.conversion_errors}")
    missing = {k for k in info.missing_keys if not k.startswith("lm_head.")}
    if missing:
        raise ModelError(f"checkpoint lacks tensors this shard needs: {sorted(missing)[:5]}")


def _check_materialized(weights: ShardWeights) -> None:
    mods = [m for m in (weights.embed, weights.norm, weights.lm_head, *weights.layers.values()) if m is not None]
    for m in mods:
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.is_meta:
                raise ModelError(f"tensor {name} was not loaded")
