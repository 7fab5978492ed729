"""presence_penalty, frequency_penalty and logit_bias at the tail equal transformers' processors.

Two nodes in threads (float32, the exact mode), real loopback sockets, a real tracker. The
reference is one transformers process generating greedily with transformers' own
``SequenceBiasLogitsProcessor`` for logit_bias, and a ``LogitsProcessor`` that applies OpenAI's
documented penalty formula to the tokens generated so far (transformers has no built-in one).
Every reference token must lead its runner-up clearly (tests/tiny_models.py), so rounding in
another order cannot flip it.
"""
from __future__ import annotations

import pytest
import torch

from fabric.compute.models import load_tokenizer, resolve
from tests.tiny_models import _COMMON, assert_clear_lead, reference_greedy

MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]
NEW_TOKENS = 16
PRESENCE, FREQUENCY = 0.5, 0.8


class OpenAIPenalties:
    """OpenAI's formula: logit[j] -= frequency * count[j] + presence * (count[j] > 0), count over
    the generated tokens only (a transformers LogitsProcessor: called with ids and scores)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row in range(scores.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] = scores[row] - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        return scores


def reference(model_dir, prompt: list[int], bias: dict[int, float]) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=_COMMON["eos_token_id"],
                         pad_token_id=0, attention_mask=torch.ones_like(ids), output_scores=True,
                         return_dict_in_generate=True,
                         sequence_bias=[[[t], b] for t, b in bias.items()] or None,
                         logits_processor=LogitsProcessorList([OpenAIPenalties(len(prompt), PRESENCE, FREQUENCY)]))
    assert_clear_lead(torch.stack(out.scores)[:, 0])  # (steps, vocab), after the processors
    return out.sequences[0, len(prompt):].tolist()


def prompt_ids(model_dir) -> list[int]:
    tok = load_tokenizer(resolve(str(model_dir)))
    return list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture
def split(tiny_split):
    return tiny_split


def _bias(model_dir, prompt: list[int]) -> dict[int, float]:
    """Ban the plain greedy reply's first token, and push a token it never uses."""
    plain = reference_greedy(model_dir, prompt, NEW_TOKENS)
    unused = next(t for t in range(10, _COMMON["vocab_size"]) if t not in plain)
    return {plain[0]: -100.0, unused: 2.5}


def test_penalties_and_bias_equal_transformers(split):
    cluster, model_dir, _ = split
    prompt = prompt_ids(model_dir)
    bias = _bias(model_dir, prompt)
    expected = reference(model_dir, prompt, bias)
    assert expected != reference_greedy(model_dir, prompt, NEW_TOKENS)  # the processors change the reply
    with cluster.client() as client:
        events = client.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS, presence_penalty=PRESENCE,
                                 frequency_penalty=FREQUENCY, logit_bias={str(t): b for t, b in bias.items()})
        assert [t for e in events for t in e.token_ids] == expected


def test_a_re_prefill_keeps_counting_the_tokens_generated(split):
    """The tail loses the session's KV mid-reply: the head re-prefills, and its opening FORWARD
    lists the tokens generated so far, so the penalties go on as if nothing happened."""
    cluster, model_dir, route = split
    prompt = prompt_ids(model_dir)
    expected = reference(model_dir, prompt, {})
    tail = cluster.nodes["tail"]
    ids: list[int] = []
    with cluster.client() as client:
        for event in client.generate(model_dir.name, messages=MESSAGES, max_tokens=NEW_TOKENS, route=route,
                                     presence_penalty=PRESENCE, frequency_penalty=FREQUENCY):
            ids.extend(event.token_ids)
            if len(ids) == 6:
                for session in tail.kv.sessions():  # evicted, as an idle timeout or a restart would
                    tail.kv.drop(session)
    assert ids == expected
    assert tail.counters["cache_miss"] >= 1


@pytest.mark.parametrize("kw, phrase", [
    (dict(presence_penalty=2.5), "penalties must be in [-2, 2]"),
    (dict(frequency_penalty="high"), "must be a finite number"),
    (dict(logit_bias={"x": 1.0}), "must be an int"),
    (dict(logit_bias={5: 500}), "bias in [-100, 100]"),
])
def test_the_client_names_a_wrong_penalty_before_sending(kw, phrase):
    from fabric import FabricError
    from fabric.client import GenerateArgs

    with pytest.raises(FabricError) as refused:
        GenerateArgs.of("m", prompt="hi", **kw)
    assert refused.value.code == "bad_request" and phrase in refused.value.message, refused.value.message
