"""Every request field the OpenAI endpoints know, and what each does: nothing is ignored.

A field is honoured (``schema`` parses it into the request), accepted as harmless (it asks
for nothing the reply could show: ``user``, ``metadata``...), or refused with a 400
``invalid_request_error`` naming it, unless its value asks for nothing (``echo: false``,
``best_of: 1``, ``response_format: {"type": "text"}``). A field no row names is refused
too: a vendor extension this server does not implement (``min_p``, ``guided_json``...)
would otherwise be dropped without a word, and the client would trust a reply that never
applied it. README's table of request fields lists these rows (a test keeps them in step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import ApiError

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"
BOTH = frozenset({CHAT, COMPLETIONS})
PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses"}


@dataclass(frozen=True)
class Rule:
    """What one field does. ``allows`` None: any value goes on to ``schema`` (honoured) or is
    accepted as it is; else only values it allows pass, and others get ``refusal``."""

    endpoints: frozenset[str]
    does: str  # what the field does here, as README's table says
    allows: Callable[[Any], bool] | None = None
    refusal: str = ""


def _is(*values: Any) -> Callable[[Any], bool]:
    """Exactly one of ``values``, type included (``true`` is not 1, ``1.0`` is not 1)."""
    return lambda v: any(type(v) is type(w) and v == w for w in values)


def _never(value: Any) -> bool:
    return False


def _honoured(endpoints: frozenset[str], does: str) -> Rule:
    return Rule(endpoints, does)


def _harmless(endpoints: frozenset[str], kind: type, does: str) -> Rule:
    """Accepted whatever it says, once it has the type OpenAI gives it."""
    return Rule(endpoints, does, lambda v: type(v) is kind, f"must be a {_JSON_TYPES[kind]}")


_JSON_TYPES = {str: "string", dict: "JSON object", bool: "boolean"}


def _only(endpoints: frozenset[str], allows: Callable[[Any], bool], does: str, refusal: str) -> Rule:
    return Rule(endpoints, does, allows, refusal)


CHAT_ONLY = frozenset({CHAT})
COMPLETIONS_ONLY = frozenset({COMPLETIONS})

FIELDS: dict[str, Rule] = {
    "model": _honoured(BOTH, "the model to run (one GET /v1/models lists)"),
    "messages": _honoured(CHAT_ONLY, "the chat; roles system (or developer, as system), user, assistant, tool; "
                          "content a string or an array of text parts (joined by newlines; an image part is "
                          "refused), null beside an assistant's tool_calls; a tool message's tool_call_id"),
    "prompt": _honoured(COMPLETIONS_ONLY, "the raw prompt: one string, or an array of one string"),
    "max_tokens": _honoured(BOTH, "tokens to generate at most; absent: the default, or what the context leaves"),
    "max_completion_tokens": _honoured(CHAT_ONLY, "as max_tokens, and wins over it"),
    "temperature": _honoured(BOTH, "0..2; 0 is greedy"),
    "top_p": _honoured(BOTH, "nucleus cut, (0, 1]"),
    "top_k": _honoured(BOTH, "vLLM's extension: sample from the k likeliest tokens; 0: all"),
    "seed": _honoured(BOTH, "sampling depends only on (seed, position): the same seed, the same reply"),
    "stop": _honoured(BOTH, "up to 4 strings; the reply ends before the first"),
    "stream": _honoured(BOTH, "server-sent chunks ending in data: [DONE]"),
    "stream_options": _honoured(BOTH, "include_usage: a last chunk carries the usage"),
    "n": _honoured(BOTH, "1 only: another value is refused"),
    "logprobs": _honoured(BOTH, "chat: true gives each token's logprob; completions: 0..20 alternatives too"),
    "top_logprobs": _honoured(CHAT_ONLY, "0..20 alternatives per token (needs logprobs: true)"),
    "ignore_eos": _honoured(BOTH, "vLLM's extension: generate max_tokens even past end-of-sequence (benchmarks)"),
    "speculation": _honoured(BOTH, "meshnet's extension: false, the head sends one token a step and never drafts "
                             "(the text is the same either way; drafts change only how many tokens a trip yields)"),
    "frequency_penalty": _honoured(BOTH, "-2..2: each token's logit falls by this times the times it was generated"),
    "presence_penalty": _honoured(BOTH, "-2..2: each token generated already has its logit lowered by this"),
    "logit_bias": _honoured(BOTH, "{token id: -100..100}, added to those tokens' logits (at most 300)"),
    "response_format": _honoured(BOTH, '{"type": "text"} (the default), "json_object" or "json_schema" (its schema at '
                                 "most 64 KiB): the tail masks every token the grammar forbids; the reply ends when "
                                 "it is complete"),
    "guided_regex": _honoured(BOTH, "vLLM's extension: the whole reply matches this regex"),
    "guided_grammar": _honoured(BOTH, "vLLM's extension: the reply follows this Lark grammar (llguidance's syntax)"),
    "tools": _honoured(CHAT_ONLY, "functions the model may call (at most 128, 64 KiB of JSON), shown through the "
                       "model's chat template (a template that cannot show them: 400); calls come back as "
                       "tool_calls, finish_reason \"tool_calls\""),
    "tool_choice": _honoured(CHAT_ONLY, '"auto" (the default: the reply is parsed for calls), "none" (no call), '
                             '"required" or {"type": "function", "function": {"name": ...}}: the tail constrains '
                             "the reply to calls whose arguments validate against the parameters"),
    "parallel_tool_calls": _honoured(CHAT_ONLY, "true (the default): a constrained reply may hold several calls "
                                     "(at most 16); false: one"),
    "functions": _only(CHAT_ONLY, _never, "refused", "deprecated by OpenAI: send tools"),
    "function_call": _only(CHAT_ONLY, _is("none"), '"none" only', "deprecated by OpenAI: send tool_choice"),
    "modalities": _only(CHAT_ONLY, _is(["text"]), '["text"] only', "only text output is supported"),
    "audio": _only(CHAT_ONLY, _never, "refused", "audio output is not supported"),
    "prediction": _only(CHAT_ONLY, _never, "refused", "predicted outputs are not supported"),
    "reasoning_effort": _only(CHAT_ONLY, _never, "refused",
                              "not supported: the model's chat template decides how it reasons"),
    "verbosity": _only(CHAT_ONLY, _never, "refused", "not supported"),
    "web_search_options": _only(CHAT_ONLY, _never, "refused", "web search is not supported"),
    "moderation": _only(CHAT_ONLY, _never, "refused", "moderation is not supported"),
    "service_tier": _only(CHAT_ONLY, _is("auto", "default"), '"auto" or "default" (one tier)',
                          'this server has one tier: send "auto" or "default"'),
    "echo": _only(COMPLETIONS_ONLY, _is(False), "false only", "echoing the prompt is not supported"),
    "best_of": _only(COMPLETIONS_ONLY, _is(1), "1 only", "only best_of=1 is supported"),
    "suffix": _only(COMPLETIONS_ONLY, _is(""), '"" only', "suffixes (insertion) are not supported"),
    "user": _harmless(BOTH, str, "accepted, no effect (an end-user id; usage is counted per API key)"),
    "safety_identifier": _harmless(CHAT_ONLY, str, "accepted, no effect (as user)"),
    "prompt_cache_key": _harmless(CHAT_ONLY, str, "accepted, no effect: prefix reuse is automatic, per API key"),
    "prompt_cache_retention": _harmless(CHAT_ONLY, str,
                                        "accepted, no effect: kept KV lives while the nodes' budget allows"),
    "prompt_cache_options": _harmless(CHAT_ONLY, dict, "accepted, no effect (as prompt_cache_key)"),
    "metadata": _harmless(CHAT_ONLY, dict, "accepted, no effect: nothing is stored"),
    "store": _harmless(CHAT_ONLY, bool, "accepted, no effect: nothing is stored"),
}


def check_fields(body: dict[str, Any], endpoint: str, rules: dict[str, Rule] | None = None) -> None:
    """A 400 naming the first field of ``body`` that ``endpoint`` does not honour or accept
    with the value given (null is absent, as everywhere in ``schema``). ``rules``: another
    endpoint's table than FIELDS (/v1/responses has its own)."""
    for name, value in body.items():
        rule = (FIELDS if rules is None else rules).get(name)
        if rule is None or endpoint not in rule.endpoints:
            raise ApiError.invalid(f"{name!s:.64} is not a field {PATHS[endpoint]} supports", name[:64],
                                   "unsupported_parameter")
        if value is not None and rule.allows is not None and not rule.allows(value):
            raise ApiError.invalid(f"{name}: {rule.refusal}", name, "unsupported_parameter")
