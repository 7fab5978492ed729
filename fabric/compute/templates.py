"""Chat templates for model files that carry none.

Most GGUF files carry their chat template (``tokenizer.chat_template``); some do not (Gemma 3
270M's Q4_K_M file). Then a chat is formatted by the family's own format, written here as
Jinja templates for transformers to render: the formats llama.cpp builds in
(``llm_chat_apply_template`` in its ``src/llama-chat.cpp``: gemma, chatml, llama3, phi3).
A format is chosen by the config's ``model_type`` and only where the vocabulary holds its
special tokens, so a turn marker is always one token and never text the model has not seen;
chatml, which llama.cpp's server falls back to for any model without a template, is tried
for every family last. Where none fits, the tokenizer gets a template that refuses every
chat with one line naming ``/v1/completions`` (raw prompts keep working).

No torch and no transformers here: ``meshnet models FILE`` reads the same choice off a
GGUF header.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Format:
    name: str  # llama.cpp's name for it (``--chat-template NAME``)
    tokens: tuple[str, ...]  # special tokens it writes: the vocabulary must hold every one
    template: str  # Jinja, without the BOS (``with_bos`` adds it)


# gemma: "assistant" is "model"; system messages (trimmed) go into the next non-model turn
_GEMMA = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + m['content'] | trim -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if ns.system and role != 'model' -%}"
    "{{- ns.system + '\\n\\n' -}}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{{- m['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
_CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_LLAMA3 = (
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
_PHI3 = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

FORMATS = {f.name: f for f in (
    Format("gemma", ("<start_of_turn>", "<end_of_turn>"), _GEMMA),
    Format("chatml", ("<|im_start|>", "<|im_end|>"), _CHATML),
    Format("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), _LLAMA3),
    Format("phi3", ("<|user|>", "<|assistant|>", "<|end|>"), _PHI3),
)}

# model_type (transformers' name, or llama.cpp's architecture name) -> formats to try, in order
FAMILY_FORMATS = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3_text"), ("gemma",)),
    **dict.fromkeys(("qwen2", "qwen2_moe", "qwen2moe", "qwen3", "qwen3_moe", "qwen3moe"), ("chatml",)),
    "llama": ("llama3",),
    "phi3": ("phi3",),
}
LAST_RESORT = "chatml"  # tried for every family: llama.cpp's server uses it for a model without a template


def choose(model_type: str, vocab: Collection[str], bos: bool = False) -> tuple[str, str] | None:
    """(name, Jinja template) of the known format for ``model_type`` whose special tokens
    ``vocab`` holds, or None. ``bos``: the tokenizer starts plain text with its BOS token (as
    llama.cpp adds it); the template then writes it, since a chat is tokenized without."""
    for name in dict.fromkeys((*FAMILY_FORMATS.get(model_type, ()), LAST_RESORT)):
        fmt = FORMATS[name]
        if all(token in vocab for token in fmt.tokens):
            return name, ("{{- bos_token -}}" if bos else "") + fmt.template
    return None


def no_template_message(model: str, model_type: str) -> str:
    return (f"model {model} has no chat template and none is known for its family ({model_type}); "
            f"send raw prompts to /v1/completions (prompt= in the Python client)")


def refusal(message: str) -> str:
    """A Jinja template that refuses every chat with ``message`` (transformers' raise_exception)."""
    return "{{- raise_exception(" + json.dumps(message) + ") -}}"


def fill_template(tokenizer, model_type: str, file_name: str, model: str) -> str | None:
    """Give ``tokenizer`` (which has no chat template) its family's, logging which; where none
    is known, a template that refuses chats (:func:`refusal`). Returns the format's name or None."""
    chosen = choose(model_type, tokenizer.get_vocab(), bos=_starts_with_bos(tokenizer))
    if chosen is None:
        log.warning("%s has no chat template and none is known for its family (%s): chat requests will be "
                    "refused; raw prompts (/v1/completions) work", file_name, model_type)
        tokenizer.chat_template = refusal(no_template_message(model, model_type))
        return None
    name, template = chosen
    log.info("%s has no chat template: using the %s template, as llama.cpp formats it", file_name, name)
    tokenizer.chat_template = template
    return name


def _starts_with_bos(tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a")["input_ids"]
    return bos is not None and bool(ids) and ids[0] == bos
