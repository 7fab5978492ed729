"""Parse and validate OpenAI request bodies into frozen ``GenerationRequest`` records.

Everything a client sends is checked here and refused with a 400 ``ApiError`` naming
the offending ``param``; nothing past this module sees untyped JSON. A field this server
does not implement is refused, never ignored (``fields``: which are honoured, harmless or
refused); so is a key of a message other than ``role``, ``content`` and ``name``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fabric.wire.protocol import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_MODEL_CHARS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    Grammar,
    ProtocolError,
    Sampling,
    Tools,
    check_message,
    json_text,
)

from .errors import ApiError
from .grammar_fields import grammar, tool_fields
from .fields import CHAT, COMPLETIONS, check_fields

if TYPE_CHECKING:
    from .config import WebUIConfig

ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system"}  # OpenAI's newer name for the system message
MAX_PARTS = 1024  # text parts of one message's content
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")  # name is accepted, and not passed on


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str | None  # None only on an assistant message that carries tool_calls
    tool_calls: tuple[dict, ...] = ()  # an assistant's calls, OpenAI's shape (arguments as JSON text)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def wire(self) -> dict:
        """The message as GENERATE carries it."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/chat/completions (``messages``) or /v1/completions (``prompt``) body."""

    model: str
    messages: tuple[ChatMessage, ...] | None  # chat requests
    prompt: str | None  # text completion requests
    max_tokens: int
    stop: tuple[str, ...]
    sampling: Sampling
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries usage
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens (as vLLM's extension; benchmarks)
    fit_context: bool = False  # max_tokens was not given: the default, or what the model's context leaves
    logprobs: int | None = None  # each token's logprob and this many alternatives; None: none asked
    presence_penalty: float = 0.0  # OpenAI's, applied at the tail
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    grammar: Grammar | None = None  # what the reply must match (response_format, guided_regex...); None: free
    tools: Tools | None = None  # functions offered (tools, tool_choice, parallel_tool_calls); None: none
    speculation: bool = True  # meshnet's extension: false, the head never drafts for this request

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``client.generate(model, ...)``."""
        messages = None
        if self.messages is not None:
            messages = [m.wire() for m in self.messages]
        return {"messages": messages, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "stop": self.stop, "sampling": self.sampling, "ignore_eos": self.ignore_eos,
                "fit_context": self.fit_context, "logprobs": self.logprobs,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "logit_bias": dict(self.logit_bias), "response_format": self.grammar, "tools": self.tools,
                "speculation": self.speculation}


# --------------------------------------------------------------------------- entry points


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError.invalid("request body nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise ApiError.invalid(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError.invalid("request body must be a JSON object")
    return body


def parse_chat(body: dict[str, Any], config: WebUIConfig) -> GenerationRequest:
    check_fields(body, CHAT)
    messages = _messages(body.get("messages"))
    chars = sum(len(m.content or "") + sum(len(json_text(c)) for c in m.tool_calls) for m in messages)
    _check_prompt_length(chars, config, "messages")
    max_tokens = _integer(body, "max_completion_tokens", None, 1, config.max_tokens_limit)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None, 1, config.max_tokens_limit)
    common = _common(body, config)
    tools = tool_fields(body, common["grammar"])
    return GenerationRequest(messages=messages, prompt=None, max_tokens=max_tokens or config.default_max_tokens,
                             fit_context=max_tokens is None, logprobs=_chat_logprobs(body), tools=tools, **common)


def parse_completion(body: dict[str, Any], config: WebUIConfig) -> GenerationRequest:
    prompt = body.get("prompt")
    if prompt is None:  # before the fields: chat's messages sent here lack a prompt, first of all
        raise ApiError.invalid("prompt is required", "prompt")
    check_fields(body, COMPLETIONS)
    if isinstance(prompt, list):  # an array of one prompt: what LangChain and others send for one call
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError.invalid("prompt must be a string or an array of one string (token ids are not "
                                   "taken, nor several prompts at once: send a request for each)", "prompt")
        prompt = prompt[0]
    prompt = _text(prompt, "prompt")
    _check_prompt_length(len(prompt), config, "prompt")
    max_tokens = _integer(body, "max_tokens", None, 1, config.max_tokens_limit)
    logprobs = _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)  # the legacy shape: an int
    return GenerationRequest(messages=None, prompt=prompt, max_tokens=max_tokens or config.default_max_tokens,
                             fit_context=max_tokens is None, logprobs=logprobs, **_common(body, config))


# --------------------------------------------------------------------------- fields


def _common(body: dict[str, Any], config: WebUIConfig) -> dict[str, Any]:
    """Fields shared by both endpoints, as GenerationRequest keyword arguments."""
    model = body.get("model")
    if model is None:
        raise ApiError.invalid("model is required", "model")
    model = _text(model, "model")
    if not model:
        raise ApiError.invalid("model is empty: name one of the models GET /v1/models lists", "model")
    if len(model) > MAX_MODEL_CHARS:
        raise ApiError.invalid(f"model must be at most {MAX_MODEL_CHARS} characters", "model")
    if _integer(body, "n", 1, 1, None) != 1:
        raise ApiError.invalid("only n=1 is supported", "n")
    stream = _boolean(body, "stream", False)
    return {"model": model, "stop": _stop(body.get("stop")), "sampling": _sampling(body, config),
            "stream": stream, "include_usage": _include_usage(body.get("stream_options"), stream),
            "ignore_eos": _boolean(body, "ignore_eos", False), "speculation": _boolean(body, "speculation", True),
            "presence_penalty": _number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
            "logit_bias": _logit_bias(body.get("logit_bias")), "grammar": grammar(body)}


def _sampling(body: dict[str, Any], config: WebUIConfig) -> Sampling:
    temperature = _number(body, "temperature", config.default_temperature, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, 0, MAX_TOP_K)
    seed = _integer(body, "seed", None, 0, MAX_SEED)
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (0..20, only with logprobs) as one
    number of alternatives; None: no logprobs."""
    wanted = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise ApiError.invalid("top_logprobs is only allowed when logprobs is true", "top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (decimal strings) to biases in [-100, 100]."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ApiError.invalid(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise ApiError.invalid(f"logit_bias keys are token ids, not {key!r:.40}", "logit_bias")
        if type(bias) not in (int, float) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ApiError.invalid(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]", "logit_bias")
        pairs.append((int(key), float(bias)))
    if len({t for t, _ in pairs}) != len(pairs):  # "7" and "07"
        raise ApiError.invalid("logit_bias names a token id twice", "logit_bias")
    return tuple(pairs)


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise ApiError.invalid("messages is required", "messages")
    if not isinstance(value, list) or not value:
        raise ApiError.invalid("messages must be a non-empty array", "messages")
    return tuple(_message(item, i) for i, item in enumerate(value))


def _message(item: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(item, dict):
        raise ApiError.invalid(f"{param} must be an object with role and content", param)
    role = item.get("role")
    role = ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise ApiError.invalid(f"{param}.role must be one of {', '.join(ROLES)} (or developer, "
                               "as system)", f"{param}.role")
    for key, value in item.items():
        if key not in MESSAGE_KEYS and value is not None:
            raise ApiError.invalid(f"{param}.{key!s:.64} is not supported in a message (only "
                                   f"{', '.join(MESSAGE_KEYS)})", f"{param}.{key!s:.64}", "unsupported_parameter")
    content = _content(item.get("content"), f"{param}.content")
    if not isinstance(content, str) and not (content is None and item.get("tool_calls")):
        raise ApiError.invalid(f"{param}.content must be a string or an array of text parts (null only "
                               "beside tool_calls)", f"{param}.content")
    try:
        check_message({**item, "role": role, "content": content})
    except ProtocolError as exc:
        where = f"{param}.tool_call_id" if "tool_call_id" in str(exc) else f"{param}.tool_calls"
        raise ApiError.invalid(f"{where}: {exc}", where) from None
    return ChatMessage(role, None if content is None else _text(content, f"{param}.content"),
                       tuple(item.get("tool_calls") or ()), item.get("tool_call_id"))


def _content(value: Any, param: str) -> Any:
    """A message's content: OpenAI's array of parts becomes its text parts joined by newlines (as
    vLLM joins them), and a part of another kind (an image, audio) is refused by name. Anything
    else comes back as it is, for the caller to check."""
    if not isinstance(value, list):
        return value
    if not value or len(value) > MAX_PARTS:
        raise ApiError.invalid(f"{param} must hold 1 to {MAX_PARTS} parts", param)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = f"of type {kind!s:.32}" if isinstance(kind, str) else "without a type"
            raise ApiError.invalid(f"{param}[{i}] is a part {shown}: this server takes text parts only "
                                   '({"type": "text", "text": ...})', f"{param}[{i}]")
        texts.append(_text(part.get("text"), f"{param}[{i}].text"))
    return "\n".join(texts)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP:
        raise ApiError.invalid(f"stop must be a string or an array of at most {MAX_STOP} strings", "stop")
    stops = tuple(_text(s, "stop") for s in items)
    if any(not s for s in stops):
        raise ApiError.invalid("stop sequences must not be empty", "stop")
    return stops


def _include_usage(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise ApiError.invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(value, dict):
        raise ApiError.invalid("stream_options must be an object", "stream_options")
    return _boolean(value, "include_usage", False, "stream_options.include_usage")


def _check_prompt_length(chars: int, config: WebUIConfig, param: str) -> None:
    if chars > config.max_prompt_chars:
        raise ApiError.invalid(f"the prompt has {chars} characters; this server accepts at most "
                               f"{config.max_prompt_chars}", param, "context_length_exceeded")


# --------------------------------------------------------------------------- scalars


def _text(value: Any, param: str) -> str:
    """A string that can be encoded as UTF-8 (JSON allows lone surrogates; we do not)."""
    if not isinstance(value, str):
        raise ApiError.invalid(f"{param} must be a string", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError.invalid(f"{param} is not valid Unicode (lone surrogate)", param) from None
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float):  # bool is an int subclass, and refused here
        raise ApiError.invalid(f"{name} must be a number", name)
    if not (low < value <= high if low_open else low <= value <= high):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError.invalid(f"{name} must be in {interval}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not int:
        raise ApiError.invalid(f"{name} must be an integer", name)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ApiError.invalid(f"{name} must be {bound}", name)
    return value


def _boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError.invalid(f"{param or name} must be a boolean", param or name)
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
