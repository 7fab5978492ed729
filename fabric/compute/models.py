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

import contextlib
import hashlib
import json
import logging
import mmap
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..wire.shard import Shard
from .empty import empty_model, one_layer
from .gguf_grid import FileGrid
from .gguf_manifest import fingerprint_of, manifest_for
from .gguf_load import (
    EMBED_TENSOR,
    OUTPUT_TENSOR,
    TENSOR_INDEX,
    Converter,
    GGUFEmbedding,
    GGUFTensors,
    groups,
    head_rows,
    layer_of,
    tensor_index,
    wanted,
)
from .model_ref import (  # noqa: F401  (re-exported: callers import model references from here too)
    _LAYER_RE,
    ALIASES,
    DEFAULT_MODEL,
    LOW_BIT_TYPES,
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
from .templates import fill_template

log = logging.getLogger(__name__)

def layer_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one decoder layer's weights take in ``dtype`` (from the architecture, no weights)."""
    params = sum(t.numel() for t in one_layer(config).parameters())
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
        with _one_metadata_parse():
            AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file).save_pretrained(tmp)
            _cache_tokenizer(AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file), tmp)
        (tmp / TENSOR_INDEX).write_text(json.dumps(tensor_index(source.path)))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target, None


_ONE_PARSE = threading.RLock()  # a block within a block (the same thread) puts back the outer one's


class _PlainMaps:
    """numpy, for gguf-py's reader, but with ``memmap`` a plain array over the same read-only
    mapping of the file. The reader slices its map about 250,000 times for a 49k-token
    vocabulary, and a memmap's every slice pays its subclass's bookkeeping: SmolLM2's metadata
    parsed in 3.8 s instead of 7.6, to the same result (``tests/test_gguf_models.py``)."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode: str = "r"):
        if mode != "r":
            return np.memmap(path, mode=mode)
        with open(path, "rb") as f:
            try:
                return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
            except ValueError:  # an empty file maps to nothing: the reader says what is wrong
                return np.memmap(path, mode=mode)


@contextlib.contextmanager
def _one_metadata_parse() -> Iterator[None]:
    """transformers parses a GGUF's whole metadata for its config, and for most families again for
    the tokenizer's config (10-15 s each for a 49k-token vocabulary on a slow CPU). Within this
    block the second parse of a file is a copy of the first's result, and the parse reads the
    file through a plain array (``_PlainMaps``)."""
    import copy

    from gguf import gguf_reader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    parsed = {}

    def once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return parse(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in parsed:
            parsed[str(path)] = parse(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    with _ONE_PARSE:  # one block at a time: each puts back what it found
        parse, gguf_utils.load_gguf_checkpoint = gguf_utils.load_gguf_checkpoint, once
        numpy, gguf_reader.np = gguf_reader.np, _PlainMaps()
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint, gguf_reader.np = parse, numpy


TOKENIZER_FROM_FILE = "tokenizer-from-gguf"  # marker: the saved tokenizer did not encode as the file's own


def _cache_tokenizer(tokenizer, target: Path) -> None:
    """Save ``tokenizer`` into ``target`` so that it loads back encoding as it does. A family's
    own class may rebuild the pipeline its way on loading (a GGUF's Gemma vocabulary of another
    kind, say): then the files are marked for the generic fast class, which reads
    ``tokenizer.json`` as it is. Where even that differs, a marker makes every load read the
    tokenizer from the GGUF file itself (seconds, but right)."""
    probe = "Hello, world! 123 <s> the quick brown fox\n\tnaïve 東京"
    try:
        want = tokenizer(probe)["input_ids"]
    except Exception:  # noqa: BLE001 -- a tokenizer that cannot encode this text is checked at use
        want = None
    tokenizer.save_pretrained(target)
    if _loads_back(target, probe, want):
        return
    settings = target / "tokenizer_config.json"
    config = json.loads(settings.read_text())
    settings.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    if _loads_back(target, probe, want):
        return
    log.info("the tokenizer saved from %s does not load back the same: it is read from the file each time",
             target.name)
    (target / TOKENIZER_FROM_FILE).touch()


def _loads_back(target: Path, probe: str, want: list[int] | None) -> bool:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target)(probe)["input_ids"] == want
    except Exception:  # noqa: BLE001 -- transformers raises many types for a tokenizer it cannot rebuild
        return False


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_config(source: ModelSource, cache_root: Path | None = None):
    from transformers import AutoConfig

    directory, gguf_file = _metadata_dir(source, cache_root)
    return AutoConfig.from_pretrained(directory, gguf_file=gguf_file)


def load_tokenizer(source: ModelSource, cache_root: Path | None = None):
    """The model's tokenizer; one whose file has no chat template gets its family's (or one
    that refuses chats with a line naming /v1/completions): see ``fabric.compute.templates``."""
    from transformers import AutoTokenizer

    directory, gguf_file = _metadata_dir(source, cache_root)
    if (directory / TOKENIZER_FROM_FILE).exists():
        directory, gguf_file = source.directory, source.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    if tokenizer.chat_template is None:
        model_type = load_config(source, cache_root).model_type
        fill_template(tokenizer, model_type, source.path.name, source.model_id)
    return tokenizer


def fingerprint(source: ModelSource, config, quant: str | None = None, cache_root: Path | None = None) -> str:
    """Digest of what determines a model's outputs: its architecture config, its weights and
    the quantization a node computes with (``:int8``/``:int4`` appended to the digest).

    Two nodes chain only when this matches: same model id is not enough. A GGUF file's is
    made of its manifest's digest (``fabric.compute.gguf_manifest``: its metadata section and
    every tensor's sha256, which fix the config too), so a partial copy fetched from peers,
    which carries its source's manifest, registers what the whole file does. Otherwise the
    config is taken without local paths and runtime-only fields (:func:`architecture`); the
    weights by the pulled manifest's digests, else by each file's size and sampled contents.
    Nothing here depends on a path, a home directory, an install location, a file's mtime or
    the machine, so two machines holding the same files agree.
    """
    if source.kind == "gguf":
        return fingerprint_of(manifest_for(source.path, cache_root).digest) + _quant_suffix(quant)
    h = hashlib.sha256(json.dumps(architecture(config), sort_keys=True, default=str).encode())
    pinned = _pulled_digests(source)
    if pinned:  # a pulled copy, maybe of some shards only: the hub's digests of all its weight files
        h.update(json.dumps(pinned, sort_keys=True).encode())
        return h.hexdigest()[:32] + _quant_suffix(quant)
    for f in sorted(source.path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())  # shard names are part of a repository
        with open(f, "rb") as fh:
            for i in range(17):  # head, 16 evenly spaced samples: cheap even for 100 GB
                fh.seek(min(size, (size * i) // 16))
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:32] + _quant_suffix(quant)


def file_placement(source: ModelSource, scheme: str, cache_root: Path | None = None) -> dict[str, FileGrid | str]:
    """Every linear's place on the kernels under ``scheme`` in a GGUF file, by parameter name
    (for a single-process reference computing as ``load_shard(quant=scheme)`` does)."""
    config = load_config(source, cache_root)
    model = empty_model(config)
    n = config.num_hidden_layers
    tensors, converter = _gguf_tensors(source, cache_root), Converter(model, config)
    placement: dict[str, FileGrid | str] = {}
    for _, infos in groups(tensors.infos, Shard(0, n - 1, n), tied=True, skip=set()):
        placement.update(converter.state(tensors, infos, scheme)[1])
    return placement


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

    ``quant`` ("int8", "int4" or "gguf": see ``fabric.compute.quant``; CPU only) loads in
    bfloat16 whatever ``dtype`` says and puts the decoder layers' linears and the lm_head on
    the weight-only kernels, a layer at a time as they load.
    """
    check_device(device, quant)
    if quant in (None, "none"):
        quant = None
    elif dtype != torch.bfloat16:
        log.info("--quant %s computes in bfloat16: loading in bfloat16, not %s", quant, dtype)
        dtype = torch.bfloat16

    config = load_config(source, cache_root)
    if config.num_hidden_layers != shard.num_layers:
        raise ModelError(f"model has {config.num_hidden_layers} layers, shard expects {shard.num_layers}")
    model = empty_model(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if source.kind == "gguf":
        lazy_embed, lm_head = _load_gguf(source, cache_root, model, config, shard, tied, dtype, quant, progress)
    else:
        lazy_embed, lm_head = None, None
        _prune(model, shard, keep_embed=shard.is_first or (shard.is_last and tied))
        _load_into(model, _safetensors_state(source, shard, tied), dtype)
    if lm_head is not None:
        model.lm_head = lm_head
    weights = _shard_weights(model, shard, lazy_embed, tied and lm_head is None, dtype, device)
    if quant is not None and source.kind != "gguf":  # --quant: see fabric/compute/quant.py
        from .quant import quantize

        del model
        quantize(weights, quant)
    return weights


def _load_gguf(source: ModelSource, cache_root: Path | None, model, config, shard: Shard, tied: bool,
               dtype: torch.dtype, quant: str | None, progress: bool) -> tuple[nn.Module | None, nn.Module | None]:
    """Load ``shard`` of a GGUF file into ``model`` a layer at a time, each layer's linears put
    on ``quant``'s kernels before the next is read. Returns (lazy embedding, lm_head): a head
    keeps its embedding in the file (where the model's embedding is a lookup), and under
    ``quant`` the lm_head is built from the file's rows in slices; None where the model's
    own modules hold them."""
    from tqdm import tqdm

    from .heap import release_freed_memory
    from .quant import quantize_modules

    tensors = _gguf_tensors(source, cache_root)
    lazy_embed = GGUFEmbedding.from_tensors(tensors, model, config) if shard.is_first else None
    head_info = None
    if quant is not None and shard.is_last:
        head_info = tensors.find(OUTPUT_TENSOR) or (tensors.find(EMBED_TENSOR) if tied else None)
    if lazy_embed is not None and tied and shard.is_last and head_info is None:
        lazy_embed = None  # the lm_head shares the loaded embedding
    # the embedding module loads where a head looks rows up in it, or a tied lm_head shares it
    embed_module = (shard.is_first and lazy_embed is None) or (shard.is_last and tied and head_info is None)
    skip = set() if embed_module else {EMBED_TENSOR}
    if head_info is not None and head_info.name != EMBED_TENSOR:
        skip.add(head_info.name)  # the untied lm_head: head_rows builds it
    _prune(model, shard, keep_embed=embed_module)
    converter = Converter(model, config)
    parts = list(groups(tensors.infos, shard, tied, skip))
    for layer, infos in tqdm(_quietly(parts), desc=f"loading layers {shard}", unit="part", total=len(parts),
                             disable=not progress):
        state, placement = converter.state(tensors, infos, quant)
        _load_into(model, state, dtype, expected=set(state))
        del state
        if quant is not None and layer is not None:  # in bfloat16 first, as a bfloat16 model quantizes
            block = model.model.layers[layer].to(dtype)
            quantize_modules([block], None, quant, grid_modules(model, placement))
        release_freed_memory()  # each layer's float copies, before the next: the peak stays one layer's
    lm_head = head_rows(tensors, head_info, quant) if head_info is not None else None
    _warn_kept(tensors, shard, quant)
    del converter, tensors
    release_freed_memory()
    return lazy_embed, lm_head


def grid_modules(model: nn.Module, grids: dict[str, FileGrid]) -> dict[nn.Module, FileGrid]:
    """{linear: its file grid} for ``grids`` named by parameter (``model.layers.0.mlp.up_proj.weight``)."""
    from .gguf_grid import KEEP

    found = {}
    for name, grid in grids.items():
        try:
            module = model.get_submodule(name.removesuffix(".weight"))
        except AttributeError:
            continue
        if isinstance(module, nn.Linear) and (grid == KEEP or tuple(module.weight.shape) == tuple(grid.shape)):
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
    if weights.embed is not None:
        _rebuild_meta_buffers(weights.embed)  # before ``to``: a meta tensor cannot be copied
    for module in (weights.embed, weights.norm, weights.lm_head, *weights.layers.values()):
        if module is not None:
            module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    weights.rotary.to(device=device)
    _check_materialized(weights)
    from . import attention, experts

    if attention.use_invariant(weights.device, dtype):  # the same bits in any chunk or batch
        config._attn_implementation = attention.NAME
        config._experts_implementation = experts.NAME
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


def _safetensors_state(source: ModelSource, shard: Shard, tied: bool) -> dict:
    from safetensors import safe_open

    state = {}
    for f in sorted(source.path.glob("*.safetensors")):
        handle = safe_open(str(f), framework="pt")  # memory-mapped; slices read lazily
        for key in handle.keys():
            if wanted(key, shard, tied):
                state[key] = handle.get_slice(key)
    return state


def _quietly(items: list) -> Iterator:
    """``items``, with transformers' own progress bar off meanwhile (it would draw one per part)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield from items
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _gguf_tensors(source: ModelSource, cache_root: Path | None) -> GGUFTensors:
    directory, _ = _metadata_dir(source, cache_root)
    return GGUFTensors.open(source.path, directory / TENSOR_INDEX)


def _warn_kept(tensors: GGUFTensors, shard: Shard, quant: str | None) -> None:
    """One warning line where the shard's layers hold types no kernel here runs on their grid."""
    if quant != "gguf":
        return
    types = {t.type_name for t in tensors.infos
             if len(t.shape) == 2 and (layer := layer_of(t.name)) is not None and shard.start <= layer <= shard.end}
    kept = sorted(types & LOW_BIT_TYPES)
    if kept:
        log.warning("%s: layers %s hold %s, which no kernel here runs on its own grid: dequantized to bfloat16 "
                    "(more memory than the file)", tensors.path.name, shard, "/".join(kept))


def _load_into(model, state: dict, dtype: torch.dtype, expected: set[str] | None = None) -> None:
    """Load ``state`` into ``model`` in ``dtype``; every tensor the shard needs must be there
    (``expected``: only these, for a part of the shard)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=dtype)
    info, _ = convert_and_load_state_dict_in_model(model, state, config)
    if info.conversion_errors:
        raise ModelError(f"could not convert weights: {info.conversion_errors}")
    missing = {k for k in info.missing_keys if not k.startswith("lm_head.") and (expected is None or k in expected)}
    if missing:
        raise ModelError(f"checkpoint lacks tensors this shard needs: {sorted(missing)[:5]}")


def _rebuild_meta_buffers(embed: nn.Module) -> None:
    """A scaled embedding's scale is a buffer no checkpoint holds (Gemma's sqrt(hidden)): it
    stayed on the meta device, so make it again from the number the module keeps."""
    buffer = getattr(embed, "embed_scale", None)
    if isinstance(buffer, torch.Tensor) and buffer.is_meta and hasattr(embed, "scalar_embed_scale"):
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale, device=embed.weight.device)


def _check_materialized(weights: ShardWeights) -> None:
    mods = [m for m in (weights.embed, weights.norm, weights.lm_head, *weights.layers.values()) if m is not None]
    for m in mods:
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.is_meta:
                raise ModelError(f"tensor {name} was not loaded")
