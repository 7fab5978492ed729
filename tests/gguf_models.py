"""Tiny random models of several families, written as GGUF files.

Nothing is downloaded. The weights are random with a fixed seed, the tokenizer is the small
byte-level BPE of ``tests/tiny_models.py`` stored the way llama.cpp stores a GPT-2 style
vocabulary, and the layout (tensor names, fused tensors, row permutations, norm offsets,
metadata keys) follows llama.cpp's ``convert_hf_to_gguf.py``, so that transformers' own GGUF
loader makes an ordinary model of each family out of the file:

    path = write_gguf("llama", tmp_path, "Q4_K")
    AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)

The file is meant as a reference input for a GGUF loader tested against transformers on the
same file; it copies no real model. Every matrix row is a multiple of 256 long, so every
GGUF type, the K-quants' 256-value super-blocks included, can hold every matrix.

Where transformers 5.24 reads a shape from the file and where it does not
-------------------------------------------------------------------------
transformers rebuilds the config from the metadata keys it maps (``GGUF_CONFIG_MAPPING`` in
``transformers/integrations/ggml.py``) and takes its config class's default for the rest, so
some shapes below follow those defaults rather than the file:

- qwen3: no key gives ``head_dim``; ``Qwen3Config`` defaults it to 128, so qwen3 files use
  head_dim 128 (4 heads of 128 over a hidden size of 256).
- qwen3_moe: ``expert_feed_forward_length`` is not read; ``moe_intermediate_size`` stays at
  its default, 768, so the experts are 768 wide.
- gemma3: no key gives the sliding-window pattern; ``Gemma3TextConfig`` makes every sixth
  layer a full-attention one, so gemma3 files get 6 layers by default (layer 5 full).
- gemma2: the softcapping values are written (as llama.cpp does) but not read; the config's
  defaults (50.0 and 30.0) are the same numbers.
- mistral: llama.cpp writes Mistral as ``llama``; transformers makes a Mistral config of it
  only when ``general.name`` is exactly ``"mistral"``, and then fails to load the weights (see
  ``FAMILIES_GGUF``).
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Mistral is left out: transformers 5.24 cannot load a Mistral GGUF. llama.cpp writes Mistral as
# architecture `llama`; transformers reads it as `mistral` when `general.name` is "mistral", but
# then maps tensor names through gguf-py's architecture "mistral", which gguf-py (0.19) does not
# have, and raises NotImplementedError("Unknown gguf model_type: mistral in gguf-py"). Named
# anything else, the same file loads as llama. `write_gguf("mistral", ...)` still writes the file
# llama.cpp would (tests/test_gguf_models.py watches for transformers learning to load it).
FAMILIES_GGUF = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe")
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
         "IQ4_NL", "IQ4_XS")

# the GGUF `general.architecture` of each family
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}

SLIDING_WINDOW = 8  # gemma2/gemma3: small, so prompts of 20+ tokens reach past it
NUM_EXPERTS, EXPERTS_PER_TOKEN = 4, 2
MOE_INTERMEDIATE = 768  # Qwen3MoeConfig's default moe_intermediate_size: transformers reads no key for it
QWEN3_HEAD_DIM = 128  # Qwen3Config's default head_dim: transformers reads no key for it
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0
WEIGHT_STD = 0.25  # as tests/tiny_models.py: clear argmax margins
# gemma multiplies the embedding by sqrt(hidden) and ties the output to it. At std 0.25 the input
# token's own row swamps what the layers add and the model echoes its input; scaled to an RMS of
# 0.25 it does not, and a final norm near 4 brings the logits' spread back to about 1.
GEMMA_EMBED_RMS = 0.25
GEMMA_OUTPUT_NORM = 4.0

_QK_K = 256
_IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32)
_IQ4_MIDPOINTS = (_IQ4_VALUES[1:] + _IQ4_VALUES[:-1]) / 2


# --------------------------------------------------------------------------------------------
# Encoders: float32 values -> GGUF blocks
# --------------------------------------------------------------------------------------------

def _fp16(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bytes (n, 2), the float32 value those bytes hold (n, 1)) of a (n, 1) array."""
    half = value.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32).reshape(-1, 1)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), 0).astype(np.float32)


def _round(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _scale_min_blocks(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K: per 32-value sub-block a scale and a min, quantized to 6 bits against the
    super-block's fp16 `d` and `dmin` as in llama.cpp; the values then to 0..levels.
    Returns (d bytes, dmin bytes, packed 12 scale bytes, q (n, 8, 32))."""
    xs = blocks.reshape(-1, 8, 32)
    low = np.minimum(xs.min(axis=-1), 0)  # llama.cpp keeps the min at or below zero
    scale = (xs.max(axis=-1) - low) / levels  # (n, 8)
    mins = -low
    d_bytes, d = _fp16(scale.max(axis=-1, keepdims=True) / 63)
    dmin_bytes, dmin = _fp16(mins.max(axis=-1, keepdims=True) / 63)
    sc = np.clip(_round(_safe_div(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(_round(_safe_div(mins, dmin)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    offset = (dmin * mn)[..., None]
    q = np.clip(_round(_safe_div(xs + offset, np.broadcast_to(step, xs.shape))), 0, levels).astype(np.uint8)
    return d_bytes, dmin_bytes, _pack_scale_min_k4(sc, mn), q


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12-byte packing that llama.cpp's get_scale_min_k4 reads: eight 6-bit scales and mins."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """Low 4 bits of (n, 8, 32) values as Q4_K/Q5_K store them: sub-blocks 2c and 2c+1 share the
    32 bytes of chunk c, in the low and high nibble."""
    q = (q & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """block_q4_K: d, dmin (fp16), scales[12], qs[128]."""
    d, dmin, scales, q = _scale_min_blocks(blocks, 15)
    return np.concatenate([d, dmin, scales, _nibbles_k(q)], axis=-1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K: d, dmin (fp16), scales[12], qh[32], qs[128]; bit s of qh[l] is the fifth bit of
    value l of sub-block s."""
    d, dmin, scales, q = _scale_min_blocks(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # (n, 8, 32)
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate([d, dmin, scales, qh, _nibbles_k(q)], axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16); 16-value sub-blocks, 6-bit values
    stored with an offset of 32."""
    xs = blocks.reshape(-1, 16, 16)
    scale = np.abs(xs).max(axis=-1) / 31  # (n, 16)
    d_bytes, d = _fp16(scale.max(axis=-1, keepdims=True) / 127)
    sc = np.clip(_round(_safe_div(scale, d)), 0, 127).astype(np.int8)
    step = np.broadcast_to((d * sc)[..., None], xs.shape)
    q = (np.clip(_round(_safe_div(xs, step)), -32, 31) + 32).astype(np.uint8)
    # within each half of 128 values, group g holds values g*32 .. g*32+31
    q = q.reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1)  # (n, 2, 64)
    qh = np.zeros((q.shape[0], 2, 32), np.uint8)
    for g in range(4):
        qh |= ((q[:, :, g] >> 4) & 3) << (2 * g)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=-1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit values (n, 256) as Q2_K/Q3_K store them: value h*128 + s*32 + l in bits 2s of byte h*32 + l."""
    q = q.reshape(-1, 2, 4, 32)
    out = np.zeros((q.shape[0], 2, 32), np.uint8)
    for s in range(4):
        out |= (q[:, :, s] & 3) << (2 * s)
    return out.reshape(-1, 64)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """block_q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin (fp16)."""
    xs = blocks.reshape(-1, 16, 16)
    low = np.minimum(xs.min(axis=-1), 0)
    scale = (xs.max(axis=-1) - low) / 3
    mins = -low
    d_bytes, d = _fp16(scale.max(axis=-1, keepdims=True) / 15)
    dmin_bytes, dmin = _fp16(mins.max(axis=-1, keepdims=True) / 15)
    sc = np.clip(_round(_safe_div(scale, d)), 0, 15).astype(np.uint8)
    mn = np.clip(_round(_safe_div(mins, dmin)), 0, 15).astype(np.uint8)
    step = np.broadcast_to((d * sc)[..., None], xs.shape)
    q = np.clip(_round(_safe_div(xs + (dmin * mn)[..., None], step)), 0, 3).astype(np.uint8)
    return np.concatenate([sc | (mn << 4), _crumbs(q.reshape(-1, 256)), d_bytes, dmin_bytes], axis=-1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """block_q3_K: hmask[32], qs[64], scales[12] (16 signed 6-bit scales), d (fp16); values -4..3
    as a low 2 bits in qs and a high bit in hmask."""
    xs = blocks.reshape(-1, 16, 16)
    # as llama.cpp: the value of largest magnitude maps to -4, so the scale carries its sign
    extreme = np.take_along_axis(xs, np.abs(xs).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = extreme / -4  # (n, 16)
    biggest = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[..., None], axis=-1)
    d_bytes, d = _fp16(biggest / -32)
    sc = np.clip(_round(_safe_div(scale, d)), -32, 31)
    step = np.broadcast_to((d * sc)[..., None], xs.shape)
    u = (np.clip(_round(_safe_div(xs, step)), -4, 3) + 4).astype(np.uint8).reshape(-1, 256)  # 0..7
    high = (u >> 2).reshape(-1, 8, 32)
    hmask = np.zeros((u.shape[0], 32), np.uint8)
    for b in range(8):
        hmask |= high[:, b] << b
    s = (sc + 32).astype(np.uint8)  # (n, 16), 0..63
    scales = np.empty((s.shape[0], 12), np.uint8)
    scales[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
    scales[:, 8:12] = 0
    for t in range(4):
        scales[:, 8:12] |= ((s[:, 4 * t:4 * t + 4] >> 4) & 3) << (2 * t)
    return np.concatenate([hmask, _crumbs(u & 3), scales, d_bytes], axis=-1)


def _iq4_index(t: np.ndarray) -> np.ndarray:
    """Index of the nearest IQ4 non-linear level to each value of t."""
    return np.searchsorted(_IQ4_MIDPOINTS, t).astype(np.uint8)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """block_iq4_nl: d (fp16), qs[16]; 32 values, indices into the 16 fixed levels, value j in the
    low nibble of byte j and value j+16 in the high one."""
    xs = blocks.reshape(-1, 32)
    extreme = np.take_along_axis(xs, np.abs(xs).argmax(axis=-1)[..., None], axis=-1)
    d_bytes, d = _fp16(extreme / -127)  # the extreme value lands on level -127
    idx = _iq4_index(_safe_div(xs, np.broadcast_to(d, xs.shape)))
    return np.concatenate([d_bytes, idx[:, :16] | (idx[:, 16:] << 4)], axis=-1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """block_iq4_xs: d (fp16), scales_h (u16), scales_l[4], qs[128]; eight 32-value sub-blocks with
    6-bit scales (offset 32), the values as in IQ4_NL."""
    xs = blocks.reshape(-1, 8, 32)
    extreme = np.take_along_axis(xs, np.abs(xs).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = extreme / -127  # (n, 8), signed
    biggest = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[..., None], axis=-1)
    d_bytes, d = _fp16(biggest / -32)
    sc = np.clip(_round(_safe_div(scale, d)), -32, 31)
    step = np.broadcast_to((d * sc)[..., None], xs.shape)
    idx = _iq4_index(_safe_div(xs, step))  # (n, 8, 32)
    ls = (sc + 32).astype(np.uint16)  # (n, 8), 0..63
    scales_h = np.zeros(ls.shape[0], np.uint16)
    for i in range(8):
        scales_h |= ((ls[:, i] >> 4) & 3) << (2 * i)
    low = (ls & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    qs = (idx[:, :, :16] | (idx[:, :, 16:] << 4)).reshape(-1, 128)
    return np.concatenate([d_bytes, scales_h.view(np.uint8).reshape(-1, 2), scales_l, qs], axis=-1)


_OWN_ENCODERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q2_K": _q2_k, "Q3_K": _q3_k,
                 "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def encode(array: np.ndarray, type_name: str) -> np.ndarray:
    """float32 (rows, cols) -> the raw GGUF block bytes (rows, bytes_per_row) of that type (uint8),
    or the float array itself for F32 and F16 (as GGUFWriter wants it). BF16 comes back as its raw
    bytes (rows, 2 * cols), numpy having no bfloat16. Any leading dimensions are kept (an expert
    stack (experts, rows, cols) gives (experts, rows, bytes_per_row))."""
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if type_name == "F32":
        return array
    if type_name == "F16":
        return array.astype(np.float16)
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block:
        raise ValueError(f"{type_name} needs rows of a multiple of {block} values; got shape {array.shape}")
    if type_name not in _OWN_ENCODERS:
        return gguf.quants.quantize(array, qtype)
    blocks = _OWN_ENCODERS[type_name](array.reshape(-1, block))
    assert blocks.shape[1] == size and blocks.dtype == np.uint8, (type_name, blocks.shape, blocks.dtype)
    return blocks.reshape(*array.shape[:-1], array.shape[-1] // block * size)


def file_grid(array: np.ndarray, type_name: str):
    """(the float32 weight, its ``fabric.compute.gguf_grid.FileGrid``) of ``array`` written as a
    Q4_0, Q4_1 or Q4_K tensor, rows in the file's order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from fabric.compute import gguf_grid

    raw = encode(array, type_name)
    exact = dequantize(raw, GGMLQuantizationType[type_name])
    return exact, gguf_grid.grid_of(exact, raw, type_name, lambda a: a)


def decode(data: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantization of what `encode` returns: float32 in the original shape."""
    import gguf

    if type_name in ("F32", "F16"):
        return np.asarray(data, dtype=np.float32)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])


# --------------------------------------------------------------------------------------------
# Type choices
# --------------------------------------------------------------------------------------------

def _kind(name: str) -> str:
    """`blk.3.attn_v.weight` -> `attn_v`; `token_embd.weight` -> `token_embd`."""
    parts = name.split(".")
    if parts[0] == "blk":
        parts = parts[2:]
    return parts[0]


def q4_k_m_mix(name: str, shape) -> str:
    """A Q4_K_M-like mix as llama.cpp writes it: attn_v and ffn_down Q6_K, token_embd and output
    Q6_K, other matrices Q4_K; 1-D tensors and the MoE router F32. A matrix whose rows are not a
    multiple of 256 falls back to Q8_0, as llama.cpp falls back to a 32-block type."""
    kind = _kind(name)
    if len(shape) < 2 or kind == "ffn_gate_inp":
        return "F32"
    if shape[-1] % _QK_K:
        return "Q8_0" if shape[-1] % 32 == 0 else "F16"
    if kind in ("attn_v", "ffn_down", "ffn_down_exps", "token_embd", "output"):
        return "Q6_K"
    return "Q4_K"


def _type_of(types, name: str, shape: tuple[int, ...]) -> str:
    if callable(types):
        return types(name, shape)
    # 1-D tensors and the router stay F32 unless named, as llama.cpp keeps them
    matrix = len(shape) >= 2 and _kind(name) != "ffn_gate_inp"
    if isinstance(types, dict):
        for key in (name, _kind(name)) + (("*",) if matrix else ()):
            if key in types:
                return types[key]
        return "F32"
    return types if matrix else "F32"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

_TOKENIZER_CACHE: dict[int, tuple[list[str], list[str]]] = {}


def tokenizer_vocab(vocab: int = 320) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as "a b") of the byte-level BPE that tests/tiny_models.py
    trains, for a vocabulary of `vocab` (padded with `[PAD<id>]` entries, as llama.cpp pads, if
    the corpus gives fewer)."""
    if vocab not in _TOKENIZER_CACHE:
        from tests import tiny_models

        with tempfile.TemporaryDirectory() as tmp:
            if vocab == tiny_models._COMMON["vocab_size"]:
                tiny_models.make_tokenizer(Path(tmp))
            else:
                _make_tokenizer(Path(tmp), vocab)
            model = json.loads((Path(tmp) / "tokenizer.json").read_text())["model"]
        by_id = {index: token for token, index in model["vocab"].items()}
        tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        _TOKENIZER_CACHE[vocab] = (tokens, merges)
    return _TOKENIZER_CACHE[vocab]


def _make_tokenizer(directory: Path, vocab: int) -> None:
    """tests/tiny_models.make_tokenizer with another vocabulary size."""
    from unittest import mock

    from tests import tiny_models

    with mock.patch.dict(tiny_models._COMMON, vocab_size=vocab):
        tiny_models.make_tokenizer(directory)


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------

def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of attn_q / attn_k rows (transformers undoes it on load)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _dims(family: str, hidden: int, vocab: int, num_layers: int) -> dict:
    heads, kv_heads = 4, 2
    return dict(hidden=hidden, intermediate=2 * hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
                head_dim=QWEN3_HEAD_DIM if family in ("qwen3", "qwen3_moe") else hidden // heads,
                layers=num_layers)


class _Draw:
    """Random tensors of a tiny model, float32, drawn from one generator in the order asked."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def matrix(self, *shape):
        return self.rng.normal(0.0, WEIGHT_STD, shape).astype(np.float32)

    def norm(self, size):
        # the scale the layer multiplies by, near 1. llama.cpp stores gemma's (1 + w) parametrisation
        # as that scale too (HF weight + 1), which transformers turns back by subtracting 1.
        return (1.0 + self.rng.normal(0.0, 0.05, size)).astype(np.float32)

    def bias(self, size):
        return self.rng.normal(0.0, 0.05, size).astype(np.float32)


def _tensors(family: str, dims: dict, rng: np.random.Generator, hf_order: bool) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names (float32): as the GGUF stores them, or with
    `hf_order` as transformers holds them (attn_q/attn_k rows not permuted, gemma norms less 1)."""
    h, draw = dims["hidden"], _Draw(rng)
    gemma = family.startswith("gemma")
    if gemma:  # see GEMMA_EMBED_RMS
        embedding = rng.normal(0.0, GEMMA_EMBED_RMS * h ** -0.5, (dims["vocab"], h)).astype(np.float32)
    else:
        embedding = draw.matrix(dims["vocab"], h)
    out = {"token_embd.weight": embedding}
    for i in range(dims["layers"]):
        out.update(_attention_tensors(family, dims, draw, hf_order, f"blk.{i}."))
        out.update(_ffn_tensors(family, dims, draw, f"blk.{i}."))
    out["output_norm.weight"] = draw.norm(h) * (GEMMA_OUTPUT_NORM if gemma else 1.0)
    if not gemma:  # gemma ties the output to the embedding: llama.cpp writes no output.weight
        out["output.weight"] = draw.matrix(dims["vocab"], h)
    if gemma and hf_order:
        out = {k: v - 1 if k.endswith("norm.weight") else v for k, v in out.items()}
    return out


def _attention_tensors(family: str, dims: dict, draw: _Draw, hf_order: bool, p: str) -> dict[str, np.ndarray]:
    """One layer's attention tensors (and its norm before), named with the layer's prefix ``p``."""
    h, hd = dims["hidden"], dims["head_dim"]
    q_rows, kv_rows = dims["heads"] * hd, dims["kv_heads"] * hd
    out = {p + "attn_norm.weight": draw.norm(h)}
    if family == "phi3":
        out[p + "attn_qkv.weight"] = draw.matrix(q_rows + 2 * kv_rows, h)
    else:
        q, k = draw.matrix(q_rows, h), draw.matrix(kv_rows, h)
        if family in ("llama", "mistral") and not hf_order:
            q, k = _permute(q, dims["heads"]), _permute(k, dims["heads"], dims["kv_heads"])
        out[p + "attn_q.weight"], out[p + "attn_k.weight"] = q, k
        out[p + "attn_v.weight"] = draw.matrix(kv_rows, h)
        if family == "qwen2":
            out[p + "attn_q.bias"], out[p + "attn_k.bias"] = draw.bias(q_rows), draw.bias(kv_rows)
            out[p + "attn_v.bias"] = draw.bias(kv_rows)
        if family in ("qwen3", "qwen3_moe", "gemma3"):
            out[p + "attn_q_norm.weight"], out[p + "attn_k_norm.weight"] = draw.norm(hd), draw.norm(hd)
    out[p + "attn_output.weight"] = draw.matrix(h, q_rows)
    if family.startswith("gemma"):
        out[p + "post_attention_norm.weight"] = draw.norm(h)
    return out


def _ffn_tensors(family: str, dims: dict, draw: _Draw, p: str) -> dict[str, np.ndarray]:
    """One layer's feed-forward tensors (and its norms), named with the layer's prefix ``p``."""
    h, ff = dims["hidden"], dims["intermediate"]
    out = {p + "ffn_norm.weight": draw.norm(h)}
    if family == "qwen3_moe":
        e, mff = NUM_EXPERTS, MOE_INTERMEDIATE
        out[p + "ffn_gate_inp.weight"] = draw.matrix(e, h)
        out[p + "ffn_gate_exps.weight"] = draw.matrix(e, mff, h)
        out[p + "ffn_up_exps.weight"] = draw.matrix(e, mff, h)
        out[p + "ffn_down_exps.weight"] = draw.matrix(e, h, mff)
    elif family == "phi3":
        out[p + "ffn_up.weight"] = draw.matrix(2 * ff, h)  # gate and up, fused, gate first
        out[p + "ffn_down.weight"] = draw.matrix(h, ff)
    else:
        out[p + "ffn_gate.weight"] = draw.matrix(ff, h)
        out[p + "ffn_up.weight"] = draw.matrix(ff, h)
        out[p + "ffn_down.weight"] = draw.matrix(h, ff)
    if family.startswith("gemma"):
        out[p + "post_ffw_norm.weight"] = draw.norm(h)
    return out


def float_tensors(family: str, *, num_layers: int | None = None, seed: int = 0, hidden: int = 256,
                  vocab: int = 320, hf_order: bool = False) -> dict[str, np.ndarray]:
    """The float32 values `write_gguf` encodes with the same arguments, under their GGUF names
    (the F32 file holds exactly these). With `hf_order`, the values as transformers should load
    them: attn_q / attn_k rows in Hugging Face order (llama, mistral) and gemma norms less 1.

    phi3 draws the same random stream as llama (its fused attn_qkv and ffn_up rows are llama's
    q, k, v and gate, up), so a phi3 and a llama file of one seed hold the same model."""
    if family not in GGUF_ARCH:
        raise ValueError(f"unknown family {family!r}; one of {tuple(GGUF_ARCH)}")
    if hidden % _QK_K:
        raise ValueError(f"hidden must be a multiple of {_QK_K}, got {hidden}")
    dims = _dims(family, hidden, vocab, num_layers or default_num_layers(family))
    return _tensors(family, dims, np.random.default_rng(seed), hf_order)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------

def _metadata(writer, family: str, dims: dict, name: str) -> None:
    arch = GGUF_ARCH[family]
    key = lambda suffix: f"{arch}.{suffix}"  # noqa: E731
    writer.add_name(name)
    writer.add_context_length(2048)
    writer.add_embedding_length(dims["hidden"])
    writer.add_block_count(dims["layers"])
    writer.add_feed_forward_length(dims["intermediate"])
    writer.add_head_count(dims["heads"])
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0 if family == "gemma3" else 10_000.0)
    writer.add_rope_dimension_count(dims["head_dim"])
    writer.add_vocab_size(dims["vocab"])
    if family in ("qwen3", "qwen3_moe", "gemma2", "gemma3"):
        writer.add_key_length(dims["head_dim"])
        writer.add_value_length(dims["head_dim"])
    if family in ("gemma2", "gemma3"):
        writer.add_sliding_window(SLIDING_WINDOW)
    if family == "gemma2":
        writer.add_float32(key("attn_logit_softcapping"), 50.0)
        writer.add_float32(key("final_logit_softcapping"), 30.0)
    if family == "qwen3_moe":
        writer.add_expert_count(NUM_EXPERTS)
        writer.add_expert_used_count(EXPERTS_PER_TOKEN)
        writer.add_expert_feed_forward_length(MOE_INTERMEDIATE)


def _tokenizer_metadata(writer, vocab: int, chat_template: bool) -> None:
    import gguf

    from tests.tiny_models import CHAT_TEMPLATE

    tokens, merges = tokenizer_vocab(vocab)
    specials = {PAD_ID, BOS_ID, EOS_ID}
    types = [gguf.TokenType.CONTROL if i in specials
             else gguf.TokenType.UNUSED if t.startswith("[PAD") else gguf.TokenType.NORMAL
             for i, t in enumerate(tokens)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(CHAT_TEMPLATE)


def _file_type(types) -> int | None:
    import gguf

    if not isinstance(types, str):
        return gguf.LlamaFileType.MOSTLY_Q4_K_M if types is q4_k_m_mix else None
    names = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_S",
             "Q5_K": "MOSTLY_Q5_K_S"}
    return gguf.LlamaFileType[names.get(types, f"MOSTLY_{types}")]


def default_num_layers(family: str) -> int:
    """4, or 6 for gemma3, whose every sixth layer is the full-attention one."""
    return 6 if family == "gemma3" else 4


def write_gguf(family: str, directory: Path, types: str | dict | Callable = "F32", *, num_layers: int | None = None,
               seed: int = 0, chat_template: bool = True, name: str = "model.gguf", hidden: int = 256,
               vocab: int = 320) -> Path:
    """Write a tiny random `family` model into directory/name and return the file's path.

    `types`: one type name (of `TYPES`) for every weight matrix, the embedding, the output and the
    MoE experts included (norms, biases and the MoE router stay F32, as llama.cpp keeps them); or
    a dict from a tensor's GGUF name, or its kind (`attn_v`, `ffn_down_exps`, ...), or `"*"` (any
    weight matrix), to a type name (anything unlisted F32); or a callable
    (gguf_tensor_name, shape) -> type name, asked about every tensor, e.g. `q4_k_m_mix`. Shapes
    are numpy's: (rows, cols), or (experts, rows, cols) for the MoE expert stacks.

    `num_layers` defaults to `default_num_layers(family)`. The same seed gives the same float
    weights whatever the types, so two files differ only by their encoding.
    """
    import gguf

    tensors = float_tensors(family, num_layers=num_layers, seed=seed, hidden=hidden, vocab=vocab)
    dims = _dims(family, hidden, vocab, num_layers or default_num_layers(family))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name

    writer = gguf.GGUFWriter(path, GGUF_ARCH[family])
    # transformers reads a llama-architecture file as Mistral only when the name is exactly this
    _metadata(writer, family, dims, "mistral" if family == "mistral" else f"tiny-{family}")
    if (file_type := _file_type(types)) is not None:
        writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_metadata(writer, vocab, chat_template)
    for tensor_name, values in tensors.items():
        type_name = _type_of(types, tensor_name, values.shape)
        if type_name not in TYPES:
            raise ValueError(f"{tensor_name}: unknown type {type_name!r}; one of {TYPES}")
        data = encode(values, type_name)
        raw_dtype = None if type_name in ("F32", "F16") else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
