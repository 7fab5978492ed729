"""Tiny random models of each supported family, saved as Hugging Face directories.

Nothing is downloaded: configs are built here, weights are random with a fixed seed, and
the tokenizer is a small byte-level BPE trained on a few sentences.

Which token comparisons are exact, and why
------------------------------------------
Tests compare greedy tokens with ``==``. That holds on any x86-64 CPU torch runs on only
where one of these is true:

- Both sides compute in the same order: the same ops on the same shapes (the same prefill
  chunks, the same batch line-up) with the same number of threads, in one process. Then
  every kernel does the same arithmetic and the results are bit-equal in any dtype. This is
  the only rule for bfloat16, int8 and int4: a 4-token chunk and an 11-token prompt, a
  padded batch and a lone row, 1 or 2 threads may each round bfloat16 sums differently
  (torch's AVX2 kernels do for a 4-token chunk, its AVX-512 ones happen not to), and the
  tokens part ways a few steps later. So a
  quantized or bfloat16 reference prefills in the split's chunks, in the test's process
  (tests/test_quant.py; ``ATEN_CPU_CAPABILITY=avx2`` shows the other kernels on any CPU).
- Float32, in a different order (one piece against chunks, alone against batched, a
  reference in this process against nodes with ``--threads 1``): logits then differ by
  float32 rounding, under 1e-4 for these models (measured up to 7e-5, a 600-token prompt in
  chunks, 1 or 2 threads). ``reference_greedy`` checks that every token it returns leads
  the runner-up by ``MIN_LEAD``, several times that, so no such difference can flip it; a
  prompt whose reference fails the check must be replaced, not the check loosened.

Never compare a bfloat16 or quantized run with a float32 one token for token, and never
hard-code expected tokens: they are those of this CPU's kernels.
"""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
MIN_LEAD = 5e-4  # float32 logits: a greedy token's least lead over the runner-up (see above)

_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
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
    """Greedy continuation from one float32 transformers process: the ground truth. Like a
    head node, it stops after the end-of-sequence token. Every token must lead by
    ``MIN_LEAD``, so that the split, computing in another order, cannot pick another."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([input_ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=_COMMON["eos_token_id"],
                         pad_token_id=0, attention_mask=torch.ones_like(ids), output_scores=True,
                         return_dict_in_generate=True)
    assert_clear_lead(torch.stack(out.scores)[:, 0])  # (steps, vocab)
    return out.sequences[0, len(input_ids):].tolist()


def assert_clear_lead(logits: torch.Tensor) -> None:
    """Every row of float32 ``logits`` (steps, vocab) has its greedy token at least
    ``MIN_LEAD`` above the runner-up, so a float32 run in another order picks the same."""
    top = logits.float().topk(2, dim=-1).values  # (steps, 2)
    leads = top[:, 0] - top[:, 1]  # (steps,)
    step = int(leads.argmin())
    assert leads[step] >= MIN_LEAD, (f"step {step}: the greedy token leads by only {float(leads[step]):.1e}; "
                                     "a float32 run in another order may pick the runner-up: use another prompt")


# Chat templates that render tools, in two families' call syntaxes, for the tiny tokenizers
# (whose own template shows no tools). Their markers are plain text in the tiny vocabulary.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>You may call these functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call></s>{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>{{ m['content'] }}"
    "{%- for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{%- endfor %}</s>"
    "{%- elif m['role'] == 'tool' %}<|tool|><tool_response>\n{{ m['content'] }}\n</tool_response></s>"
    "{%- else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
LLAMA3_TOOLS_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    'Answer with a JSON object {"name": function name, "parameters": its arguments}.\n'
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}"
    "<|end_header_id|>\n\n"
    "{%- if m['tool_calls'] %}{%- for c in m['tool_calls'] %}"
    "{{ {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}"
    "{%- endfor %}{%- else %}{{ m['content'] }}{%- endif %}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def with_template(source: Path, directory: Path, template: str) -> Path:
    """A copy of the model at ``source`` in ``directory`` whose tokenizer has ``template``."""
    import shutil

    directory = Path(directory)
    if not directory.is_dir():
        shutil.copytree(source, directory)
    (directory / "chat_template.jinja").write_text(template)
    return directory


def make_draft(source: Path, directory: Path, noise: float, seed: int = 1) -> Path:
    """A draft model for the model at ``source``: a copy whose weights each moved by random noise
    of ``noise`` standard deviation, with the same tokenizer (its greedy tokens agree with the
    source's often, not always: a draft whose drafts are partly kept)."""
    import shutil

    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * noise)
    model.save_pretrained(directory)
    for name in Path(source).iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, directory / name.name)
    return directory


def with_other_tokenizer(source: Path, directory: Path) -> Path:
    """A copy of the model at ``source`` whose tokenizer was trained on other text (its ids
    name other strings): no draft model for ``source``."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    if not directory.is_dir():
        shutil.copytree(source, directory)
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=_COMMON["vocab_size"], special_tokens=["<pad>", "<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(["pack my box with five dozen liquor jugs", "sphinx of black quartz"] * 20, trainer)
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                pad_token="<pad>").save_pretrained(directory)
    return directory
