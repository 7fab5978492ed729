"""GGUF files as they come: without a chat template (the family's, as llama.cpp formats it,
or a clear refusal of chats), described by `meshnet models FILE`, and refused in one line
when no node can run them (an unknown architecture, a tensor type gguf-py cannot read, a
file cut short, not GGUF at all)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import subprocess
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
from jinja2.exceptions import TemplateError

from fabric.client import AsyncClient, FabricError
from fabric.compute import gguf_info, templates
from fabric.compute.model_ref import ModelError, gguf_tensor_types, resolve
from fabric.node.route_session import RequestError, encode_prompt
from fabric.wire.protocol import ErrorCode, Generate, Hop
from tests import gguf_models
from tests.cluster import ROOT, ThreadCluster
from tests.gguf_models import q4_k_m_mix, write_gguf
from tests.support import cli

VOCAB = 384  # write_gguf's vocabulary padded to this size: its last 48 entries are free for special tokens
GEMMA_TOKENS = ("<start_of_turn>", "<end_of_turn>")
CHATS = (
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": " be brief \n"}, {"role": "user", "content": "  hi there \n"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": " b "},
     {"role": "user", "content": "c"}],
)


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def special_tokens(tokens: tuple[str, ...]):
    """write_gguf writes a VOCAB-entry vocabulary whose last entries are ``tokens``, marked
    control tokens as llama.cpp marks a family's turn markers."""
    base, merges = gguf_models.tokenizer_vocab(VOCAB)
    first = VOCAB - len(tokens)
    if not all(t.startswith("[PAD") for t in base[first:]):
        raise RuntimeError("the vocabulary has no free entries for special tokens")
    vocab = base[:first] + list(tokens)
    add_types = gguf.GGUFWriter.add_token_types

    def control(writer, types):
        add_types(writer, [gguf.TokenType.CONTROL if i >= first else t for i, t in enumerate(types)])

    with (mock.patch.object(gguf_models, "tokenizer_vocab", lambda size: (vocab, merges)),
          mock.patch.object(gguf.GGUFWriter, "add_token_types", control)):
        yield


ENCODE = gguf_models.encode  # write_gguf's own encoder, before it is patched


def _encode(values: np.ndarray, type_name: str) -> np.ndarray:
    """gguf_models.encode, and types it has no encoder for: MXFP4 by gguf-py, Q8_1 as zero blocks."""
    if type_name == "MXFP4":
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.MXFP4)
    if type_name == "Q8_1":
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
        return np.zeros((values.shape[0], values.shape[-1] // block * size), np.uint8)
    return ENCODE(values, type_name)


def write_typed(directory: Path, layer_type: str, name: str) -> Path:
    """A llama file whose decoder-layer matrices are ``layer_type`` (any GGML type gguf-py writes)."""
    with (mock.patch.object(gguf_models, "TYPES", (*gguf_models.TYPES, "MXFP4", "Q8_1")),
          mock.patch.object(gguf_models, "encode", _encode)):
        return write_gguf("llama", directory, lambda n, shape: layer_type if n.startswith("blk.") and len(shape) == 2
                          else "F32", num_layers=2, name=name)


def set_type(path: Path, tensor: str, type_id: int) -> None:
    """Rewrite tensor ``tensor``'s GGML type number in the header of ``path``."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * dims, type_id)
    path.write_bytes(data)


def write_arch(path: Path, arch: str) -> Path:
    """A small GGUF file of architecture ``arch``, written by gguf-py's writer directly."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_tensor("token_embd.weight", np.zeros((64, 256), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((256, 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def header_end(path: Path) -> int:
    """Where the tensor data of ``path`` begins."""
    return min(t.offset for t in gguf_info.read_header(path).tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Every file these tests read: good ones, and each kind of bad one."""
    d = tmp_path_factory.mktemp("gguf-files")
    made = {"good": write_gguf("llama", d, q4_k_m_mix, name="good.gguf"),
            "bare": write_gguf("llama", d, "Q8_0", chat_template=False, name="bare-llama.gguf")}
    with special_tokens(GEMMA_TOKENS):
        made["gemma"] = write_gguf("gemma3", d, "Q8_0", chat_template=False, vocab=VOCAB, name="gemma-bare.gguf")
    made["mamba2"] = write_arch(d / "mamba2.gguf", "mamba2")
    made["q8_1"] = write_typed(d, "Q8_1", "q8-1-layers.gguf")
    made["mxfp4"] = write_typed(d, "MXFP4", "mxfp4-layers.gguf")
    made["type99"] = write_typed(d, "Q8_0", "type99.gguf")
    set_type(made["type99"], "blk.1.attn_q.weight", 99)
    data = made["good"].read_bytes()
    made["half"], made["cut-header"], made["text"] = d / "half.gguf", d / "cut-header.gguf", d / "notes.gguf"
    made["half"].write_bytes(data[:len(data) // 2])
    made["cut-header"].write_bytes(data[:header_end(made["good"]) // 2])
    made["text"].write_text("these are my notes, not a model\n")
    return made


# ----------------------------------------------------------------------------------------------
# 1. chat templates: llama.cpp's formats, chosen by family and vocabulary
# ----------------------------------------------------------------------------------------------

def llama_cpp(name: str, chat: list[dict], add_ass: bool = True) -> str:
    """llm_chat_apply_template of llama.cpp's src/llama-chat.cpp for these formats, line by line."""
    out = ""
    if name == "gemma":
        system = ""
        for m in chat:
            if m["role"] == "system":
                system += m["content"].strip()
                continue
            role = "model" if m["role"] == "assistant" else m["role"]
            out += f"<start_of_turn>{role}\n"
            if system and role != "model":
                out, system = out + system + "\n\n", ""
            out += m["content"].strip() + "<end_of_turn>\n"
        return out + ("<start_of_turn>model\n" if add_ass else "")
    if name == "chatml":
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat)
        return out + ("<|im_start|>assistant\n" if add_ass else "")
    if name == "llama3":
        out = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                      for m in chat)
        return out + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_ass else "")
    if name == "phi3":
        out = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in chat)
        return out + ("<|assistant|>\n" if add_ass else "")
    raise ValueError(name)


@pytest.fixture(scope="module")
def tokenizer(files):
    from fabric.compute.models import load_tokenizer

    return load_tokenizer(resolve(str(files["good"])))


@pytest.mark.parametrize("name", sorted(templates.FORMATS))
@pytest.mark.parametrize("add_ass", [True, False])
def test_each_template_renders_what_llama_cpp_writes(tokenizer, name, add_ass):
    template = templates.FORMATS[name].template
    for chat in CHATS:
        rendered = tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_ass)
        assert rendered == llama_cpp(name, chat, add_ass)


def test_the_template_follows_the_family_and_needs_its_tokens_in_the_vocabulary():
    llama3 = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}
    chatml = {"<|im_start|>", "<|im_end|>"}
    assert templates.choose("gemma3_text", {"a", *GEMMA_TOKENS})[0] == "gemma"
    assert templates.choose("gemma3", {"a", *GEMMA_TOKENS})[0] == "gemma"  # llama.cpp's name for it too
    assert templates.choose("qwen3_moe", chatml)[0] == "chatml"
    assert templates.choose("llama", llama3 | chatml)[0] == "llama3"
    assert templates.choose("llama", chatml)[0] == "chatml"  # SmolLM2 is a llama with chatml's tokens
    assert templates.choose("phi3", {"<|user|>", "<|assistant|>", "<|end|>"})[0] == "phi3"
    assert templates.choose("llama", {"a", "b"}) is None  # no known format's tokens: nothing is guessed
    assert templates.choose("gemma2", {"<start_of_turn>"}) is None  # half of them is not enough
    assert templates.choose("phi3", {"<|user|>", "<|end|>"}) is None
    name, template = templates.choose("gemma3_text", set(GEMMA_TOKENS), bos=True)
    assert template.startswith("{{- bos_token -}}") and template.endswith(templates.FORMATS["gemma"].template)


def test_the_template_writes_bos_where_the_tokenizer_starts_text_with_it():
    class Tokenizer:  # as a sentencepiece tokenizer that adds BOS (Gemma's): a chat is tokenized without it
        bos_token_id, chat_template = 2, None

        def get_vocab(self):
            return {"<bos>": 2, **{t: 10 + i for i, t in enumerate(GEMMA_TOKENS)}}

        def __call__(self, text):
            return {"input_ids": [2, 7]}

    tok = Tokenizer()
    assert templates.fill_template(tok, "gemma3_text", "g.gguf", "g") == "gemma"
    assert tok.chat_template == "{{- bos_token -}}" + templates.FORMATS["gemma"].template


def test_a_file_without_a_template_gets_its_familys_and_one_log_line(files, caplog):
    from fabric.compute.models import load_tokenizer

    with caplog.at_level(logging.INFO, logger="fabric.compute.templates"):
        tok = load_tokenizer(resolve(str(files["gemma"])))
    lines = [r.getMessage() for r in caplog.records if r.name == "fabric.compute.templates"]
    assert lines == ["gemma-bare.gguf has no chat template: using the gemma template, as llama.cpp formats it"]
    chat = CHATS[1]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == llama_cpp("gemma", chat)
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    start = tok.convert_tokens_to_ids("<start_of_turn>")
    assert start >= VOCAB - len(GEMMA_TOKENS) and ids[0] == start and ids.count(start) == 2  # one token each


def test_a_file_with_a_template_keeps_it(tokenizer):
    from tests.tiny_models import CHAT_TEMPLATE

    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_a_file_whose_family_has_no_known_template_refuses_chats_naming_completions(files):
    from fabric.compute.models import load_tokenizer

    tok = load_tokenizer(resolve(str(files["bare"])))
    with pytest.raises(TemplateError, match="/v1/completions"):
        tok.apply_chat_template(CHATS[0], add_generation_prompt=True)
    route = (Hop("n", "tcp://127.0.0.1:1", 0, 3),)
    request = Generate("r1", route, messages=tuple(CHATS[0]), max_tokens=8)
    with pytest.raises(RequestError) as refused:
        encode_prompt(tok, request, 4096)
    assert refused.value.code == ErrorCode.BAD_REQUEST
    assert str(refused.value) == ("model bare-llama has no chat template and none is known for its family (llama); "
                                  "send raw prompts to /v1/completions (prompt= in the Python client)")
    raw = Generate("r2", route, prompt="the quick brown fox", max_tokens=8)
    assert encode_prompt(tok, raw, 4096)  # raw prompts keep working


# ----------------------------------------------------------------------------------------------
# ... through a node, the Python client and the web UI's OpenAI API
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(files):
    """A node serving all of bare-llama (no template known), one all of gemma-bare (its family's)."""
    c = ThreadCluster()
    c.add_node(files["bare"], 0, 3, 4, "bare")
    c.add_node(files["gemma"], 0, 5, 6, "gemma")
    c.wait_routable("bare-llama", 2)
    c.wait_routable("gemma-bare", 2)
    yield c
    c.close()


def test_the_client_gets_one_clear_error_and_the_node_keeps_serving(cluster):
    with cluster.client() as client:
        with pytest.raises(FabricError) as refused:
            list(client.generate("bare-llama", messages=CHATS[0], max_tokens=4))
        assert refused.value.code == ErrorCode.BAD_REQUEST
        assert "no chat template" in str(refused.value) and "/v1/completions" in str(refused.value)
        assert "\n" not in str(refused.value) and "Traceback" not in str(refused.value)
        events = list(client.generate("bare-llama", prompt="the quick brown", max_tokens=3, ignore_eos=True))
        assert sum(len(e.token_ids) for e in events) == 3
        chat = list(client.generate("gemma-bare", messages=CHATS[1], max_tokens=3, ignore_eos=True))
        assert chat[-1].prompt_tokens > 0 and sum(len(e.token_ids) for e in chat) == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_the_openai_api_answers_400_for_chats_and_serves_completions(cluster, stream):
    from webui import WebUIConfig, create_app

    async with AsyncClient(cluster.endpoint, timeout=30) as fabric:
        client = create_app(WebUIConfig(tracker=cluster.endpoint), fabric).test_client()
        chat = {"model": "bare-llama", "messages": CHATS[0], "max_tokens": 3, "stream": stream}
        response = await client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 400, await response.get_data()
        error = (await response.get_json())["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "bad_request"
        assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
        text = {"model": "bare-llama", "prompt": "the quick brown", "max_tokens": 3, "stream": stream}
        response = await client.post("/v1/completions", json=text)
        assert response.status_code == 200, await response.get_data()


# ----------------------------------------------------------------------------------------------
# 2. meshnet models FILE
# ----------------------------------------------------------------------------------------------

def meshnet(*args: str, timeout: float = 60, report_torch: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "1000"}
    return subprocess.run([*cli(report_torch), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=env)


def one_error_line(out: subprocess.CompletedProcess, *named: str) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith("meshnet: error: "), out.stderr
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


def test_the_header_reads_as_gguf_py_reads_it(files):
    header = gguf_info.read_header(files["good"], frozenset({gguf_info.TOKENS}))
    reader = gguf.GGUFReader(str(files["good"]))
    assert [(t.name, t.type_name, t.shape, t.offset, t.nbytes) for t in header.tensors] == [
        (t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data_offset, int(t.n_bytes))
        for t in reader.tensors]
    assert header.metadata[gguf_info.TOKENS] == gguf_models.tokenizer_vocab(320)[0]
    assert header.architecture == "llama" and header.key("block_count") == 4


def test_models_file_describes_the_mix_and_each_layer(files):
    info = gguf_info.describe(files["good"])
    assert (info["architecture"], info["layers"], info["hidden_size"], info["vocab_size"]) == ("llama", 4, 256, 320)
    assert info["runs"] and info["problems"] == [] and info["chat_template"] == {"source": "file", "name": None}
    mix = {t["type"]: t for t in info["types"]}
    assert set(mix) == {"Q4_K", "Q6_K", "F32"}
    assert sum(t["bytes"] for t in info["types"]) == sum(int(t.n_bytes) for t in gguf.GGUFReader(
        str(files["good"])).tensors)
    assert [r["layer"] for r in info["per_layer"]] == [0, 1, 2, 3]
    assert all(r["types"] == ["F32", "Q4_K", "Q6_K"] and r["bytes"] == info["per_layer"][0]["bytes"]
               for r in info["per_layer"])
    assert info["embedding"] == {"name": "token_embd.weight", "type": "Q6_K", "shape": [256, 320],
                                 "bytes": 320 * 256 // 256 * 210}
    assert info["output"]["type"] == "Q6_K" and info["quant_auto"]["scheme"] == "gguf"
    assert gguf_info.describe(files["gemma"])["chat_template"] == {"source": "family", "name": "gemma"}
    assert gguf_info.describe(files["gemma"])["output"] is None  # gemma ties its output to the embedding
    assert gguf_info.describe(files["bare"])["chat_template"] == {"source": "none", "name": None}


def test_models_file_on_the_command_line_as_text_and_json(files):
    out = meshnet("models", str(files["good"]))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    for text in ("architecture   llama", "layers         4", "hidden size    256", "vocabulary     320",
                 "chat template  in the file", "Q4_K", "Q6_K", "token_embd.weight", "output.weight"):
        assert text in out.stdout, text
    assert sum(line[:1].isdigit() for line in out.stdout.splitlines()) == 4  # a row per layer
    as_json = json.loads(meshnet("models", str(files["gemma"]), "--json").stdout)
    assert as_json["chat_template"] == {"source": "family", "name": "gemma"} and as_json["layers"] == 6
    listing = meshnet("models", "--json")  # without FILE: the list, as before
    assert listing.returncode == 0 and "aliases" in json.loads(listing.stdout)


# ----------------------------------------------------------------------------------------------
# 3. files no node can run: one line naming the file and what is wrong
# ----------------------------------------------------------------------------------------------

BAD = {
    "mamba2": ("mamba2.gguf", "architecture 'mamba2' is not one meshnet runs", "llama"),
    "q8_1": ("q8-1-layers.gguf", "blk.0.attn_q.weight and 13 more tensors are Q8_1, which gguf", "cannot dequantize"),
    "type99": ("type99.gguf", "tensor blk.1.attn_q.weight has GGML type 99", "pip install -U gguf"),
    "half": ("half.gguf", "truncated", "tensors cut off", "download it again"),
    "cut-header": ("cut-header.gguf", "truncated: it ends inside its header"),
    "text": ("notes.gguf", "is not a GGUF file"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_check_runnable_says_what_is_wrong_in_one_line(files, kind):
    with pytest.raises(ModelError) as refused:
        gguf_info.check_runnable(files[kind])
    assert "\n" not in str(refused.value)
    for text in BAD[kind]:
        assert text in str(refused.value)


def test_types_gguf_py_dequantizes_run_and_the_others_are_named():
    assert gguf_info.type_problems({"a": "Q4_K", "b": "MXFP4", "c": "TQ1_0", "d": "IQ2_XXS", "e": "F32"}) == []
    found = gguf_info.type_problems({"x.0": "Q8_K", "x.1": "Q8_K", "y": "I32", "z": "type 77"})
    assert [f.split(",")[0] for f in found] == ["tensor y is I32", "x.0 and 1 more tensors are Q8_K",
                                                "tensor z has GGML type 77"]


def test_a_type_meshnet_has_no_kernel_for_still_runs_in_float(files):
    info = gguf_info.describe(files["mxfp4"])
    assert info["problems"] == [] and {"MXFP4"} <= {t["type"] for t in info["types"]}
    assert info["quant_auto"] == {"scheme": None, "why": "its layers are MXFP4; no kernel here holds MXFP4"}


@pytest.mark.parametrize("cut", [0, 3, 10, 24, 100, 2000, -40, -33])  # negative: before the data (padding < 32)
def test_the_header_readers_give_model_errors_wherever_a_file_is_cut(files, tmp_path, cut):
    data = files["good"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut if cut >= 0 else header_end(files["good"]) + cut])
    for read in (gguf_tensor_types, gguf_info.read_header):
        with pytest.raises(ModelError, match="cut.gguf"):
            read(path)


@pytest.mark.parametrize("command", [("node", "--layers", "0-1", "--tracker", "127.0.0.1:1"), ("up",)],
                         ids=["node", "up"])
@pytest.mark.parametrize("kind", ["mamba2", "type99", "half", "cut-header", "text"])
def test_node_and_up_refuse_a_file_they_cannot_run_in_one_line_before_torch_loads(files, kind, command):
    out = meshnet(command[0], "--model", str(files[kind]), *command[1:], report_torch=True)
    assert out.returncode == 2
    one_error_line(out, *BAD[kind])
    assert out.stdout.split() == ["torch:", "False"]  # refused in a second, not after torch's five


@pytest.mark.parametrize("kind", sorted(BAD))
def test_models_file_refuses_a_file_no_node_can_run_in_one_line(files, kind):
    out = meshnet("models", str(files[kind]))
    assert out.returncode == 1
    one_error_line(out, *BAD[kind])


@pytest.mark.parametrize("family,types", [("llama", "Q4_K"), ("qwen3", "Q8_0"), ("gemma3", "F16"), ("llama", q4_k_m_mix),
                                          ("qwen2", {"attn_v": "Q5_1", "ffn_down": "BF16", "*": "Q4_0"})])
def test_the_tensor_index_is_gguf_readers_table_without_parsing_every_field(tmp_path, family, types):
    """``tensor_index`` reads the header itself (gguf-py's reader turns every metadata field into
    arrays, seconds for a real vocabulary): each entry is the one GGUFReader gives."""
    from fabric.compute.gguf_load import tensor_index

    path = write_gguf(family, tmp_path, types, num_layers=2)
    reader = gguf.GGUFReader(str(path))
    expected = [{"name": t.name, "tensor_type": int(t.tensor_type), "offset": int(t.data_offset),
                 "dtype": t.data.dtype.str, "shape": tuple(t.data.shape)} for t in reader.tensors]
    assert tensor_index(path) == expected and len({e["dtype"] for e in expected}) >= 2


def test_a_damaged_tensor_table_is_named(tmp_path):
    from fabric.compute.gguf_load import tensor_index

    path = write_gguf("llama", tmp_path, "Q4_0", num_layers=1)
    info = gguf_info.read_header(path).tensors[0]
    data = bytearray(path.read_bytes())
    at = data.index(info.name.encode()) + len(info.name) + 4 + 8 * len(info.shape)  # the tensor's type id
    data[at:at + 4] = struct.pack("<I", 999)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="cannot read its tensor table"):
        tensor_index(path)


def test_a_first_start_parses_the_files_metadata_once_for_its_config_and_tokenizer(tmp_path, monkeypatch):
    """transformers parses a llama GGUF's whole metadata for the config and again for the
    tokenizer's; the one-time cache of config and tokenizer needs it once, and puts it back."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from fabric.compute import models

    parse, calls = gguf_utils.load_gguf_checkpoint, []

    def counted(path, return_tensors=False, **kwargs):
        calls.append(return_tensors)
        return parse(path, return_tensors=return_tensors, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    source = resolve(str(write_gguf("llama", tmp_path, "Q8_0", num_layers=1)))
    directory, _ = models._metadata_dir(source, tmp_path / "cache")
    assert calls == [False] and gguf_utils.load_gguf_checkpoint is counted
    assert (directory / "config.json").is_file() and models.load_tokenizer(source, tmp_path / "cache")("hi")["input_ids"]
