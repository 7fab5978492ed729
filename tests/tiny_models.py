"""Tiny random models of each supported family, saved as Hugging Face directories.

Nothing is downloaded: configs are built here, weights are random with a fixed seed, and
the tokenizer is a small byte-level BPE trained on a few sentences.
"""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")

_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_config(family: str, num_layers: int = 6):
    import transformers as tf

    kw = dict(_COMMON, num_hidden_layers=num_layers)
    if family == "llama":
        return tf.LlamaConfig(**kw)
    if family == "qwen2":
        return tf.Qwen2Config(**kw)
    if family == "qwen3":
        return tf.Qwen3Config(**kw, head_dim=16)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**kw, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, decoder_sparse_step=1)
    if family == "mistral":
        return tf.MistralConfig(**kw, sliding_window=None)
    raise ValueError(family)


def make_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_COMMON["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "meshnet splits a model across nodes",
            "hello world, how are you today?"] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def make_model(family: str, directory: Path, num_layers: int = 6, seed: int = 0) -> Path:
    """Save a random ``family`` model with ``num_layers`` layers into ``directory``."""
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, num_layers))
    # random init is small; widen the weights so logits have clear argmax margins
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    model.save_pretrained(directory)
    make_tokenizer(directory)
    return directory


def reference_greedy(directory: Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation from one transformers process: the ground truth. Like a head
    node, it stops after the end-of-sequence token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([input_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=_COMMON["eos_token_id"],
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(input_ids):].tolist()
