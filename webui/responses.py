"""The Responses API's request (POST /v1/responses), read as the chat it describes.

OpenAI's newer endpoint, which its Agents SDK and coding agents speak by default, carries the
same conversation as a chat completion in other shapes: ``input`` (a string, or items: messages
whose content is text parts, ``function_call`` items the model made and
``function_call_output`` items answering them), ``instructions`` (a system message first),
``max_output_tokens``, ``text.format`` (a JSON schema's grammar) and flat function tools.
``chat_body`` rewrites a request into a chat completions body, which ``parse_chat`` then reads
as it reads any, so both endpoints check every value alike. A request may continue a response
this web UI kept by ``previous_response_id`` (webui/responses_store.py). Every field is
honoured, accepted as harmless, or refused, as on the other endpoints (``RULES``; README, *The
Responses API*).
"""
from __future__ import annotations

from typing import Any

from .errors import ApiError
from .fields import RESPONSES as ENDPOINT
from .fields import Rule, _harmless, _is, _never, _only, check_fields

RESPONSES = frozenset({ENDPOINT})
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")  # a part's types that carry text
MAX_ITEMS = 4096  # items of one input


def _does(does: str) -> Rule:
    return Rule(RESPONSES, does)


RULES: dict[str, Rule] = {
    "model": _does("the model to run (one GET /v1/models lists)"),
    "input": _does("a string (one user message), or items: messages (role user, assistant, system or developer; "
                   "content a string or text parts), function_call and function_call_output items"),
    "instructions": _does("a system message before the input"),
    "max_output_tokens": _does("tokens to generate at most, as max_tokens"),
    "temperature": _does("0..2; 0 is greedy"),
    "top_p": _does("nucleus cut, (0, 1]"),
    "stream": _does("server-sent events, response.created to response.completed"),
    "tools": _does('function tools ({"type": "function", "name", "parameters"...}), as chat\'s tools'),
    "tool_choice": _does('"auto", "none", "required" or {"type": "function", "name": ...}, as chat\'s'),
    "parallel_tool_calls": _does("as chat's"),
    "text": _does('{"format": {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "schema": '
                  '...}}: the tail masks what the grammar forbids'),
    "store": _does("true (the default): the conversation is kept for previous_response_id; false: not kept"),
    "metadata": _harmless(RESPONSES, dict, "accepted, repeated in the response"),
    "user": _harmless(RESPONSES, str, "accepted, no effect (as chat's)"),
    "safety_identifier": _harmless(RESPONSES, str, "accepted, no effect"),
    "prompt_cache_key": _harmless(RESPONSES, str, "accepted, no effect: prefix reuse is automatic, per API key"),
    "stream_options": _harmless(RESPONSES, dict, "accepted, no effect"),
    "prompt_cache_retention": _harmless(RESPONSES, str, "accepted, no effect: kept KV lives while the nodes' "
                                        "budget allows"),
    "prompt_cache_options": _harmless(RESPONSES, dict, "accepted, no effect (as prompt_cache_key)"),
    "service_tier": _only(RESPONSES, _is("auto", "default"), '"auto" or "default" (one tier)',
                          'this server has one tier: send "auto" or "default"'),
    "truncation": _only(RESPONSES, _is("disabled"), '"disabled" only',
                        "the conversation is never cut: a prompt too long is refused"),
    "include": _only(RESPONSES, _is([]), "[] only", "nothing more can be included"),
    "top_logprobs": _only(RESPONSES, _is(0), "0 only", "logprobs are served by /v1/chat/completions"),
    "background": _only(RESPONSES, _is(False), "false only", "background responses are not supported"),
    "previous_response_id": _does("continue a response this web UI kept (store not false; the last 256, per API "
                                  "key, in memory): its conversation comes before the input"),
    "conversation": _only(RESPONSES, _never, "refused", "the Conversations API is not supported: send the "
                          "conversation as input, or previous_response_id"),
    "prompt": _only(RESPONSES, _never, "refused", "stored prompt templates are not supported"),
    "reasoning": _only(RESPONSES, _never, "refused", "not supported: the model's chat template decides how it "
                       "reasons"),
    "max_tool_calls": _only(RESPONSES, _never, "refused", "not supported: use parallel_tool_calls"),
    "context_management": _only(RESPONSES, _never, "refused", "the conversation is never compacted"),
    "moderation": _only(RESPONSES, _never, "refused", "moderation is not supported"),
    "image": _only(RESPONSES, _never, "refused", "images are not supported"),
    "access_programs": _only(RESPONSES, _never, "refused", "not supported"),
    "background_options": _only(RESPONSES, _never, "refused", "background responses are not supported"),
}


def checked(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` once its fields are known and allowed; a 400 naming the first that is not."""
    check_fields(body, ENDPOINT, RULES)
    if body.get("input") is None:
        raise ApiError.invalid("input is required", "input")
    for name, kind in (("instructions", str), ("previous_response_id", str), ("store", bool)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise ApiError.invalid(f"{name} must be a {'string' if kind is str else 'boolean'}", name)
    return body


def turn(body: dict[str, Any], earlier: list[dict] = ()) -> list[dict]:
    """The conversation this request continues (``earlier``, a kept response's) and its input, as
    chat messages: what the next request may continue from, with this response's turn."""
    return [*earlier, *_messages(body["input"])]


def chat_body(body: dict[str, Any], messages: list[dict]) -> dict[str, Any]:
    """The chat completions body of ``body`` (checked) over the conversation ``messages``."""
    instructions = body.get("instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    chat = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
            "max_completion_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "parallel_tool_calls": body.get("parallel_tool_calls"),
            "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
            "response_format": _format(body.get("text"))}
    return {k: v for k, v in chat.items() if v is not None}


def echo(body: dict[str, Any]) -> dict[str, Any]:
    """What a response object repeats of its request, with OpenAI's defaults where it named none."""
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "store": body.get("store") is not False, "previous_response_id": body.get("previous_response_id"),
            "reasoning": None, "truncation": "disabled"}


def _messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ITEMS:
        raise ApiError.invalid(f"input must be a string or an array of 1 to {MAX_ITEMS} items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ApiError.invalid(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, f"input[{i}]"))
        elif kind == "function_call":
            call = chat_call(_string(item, "call_id", i), _string(item, "name", i), _string(item, "arguments", i))
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                        "content": _string(item, "output", i)})
        else:
            raise ApiError.invalid(f"input[{i}] is an item of type {kind!s:.32}: this server takes messages, "
                                   "function_call and function_call_output items", f"input[{i}].type")
    return out


def chat_call(call_id: str, name: str, arguments: str) -> dict:
    """A function call as an assistant's chat message holds it (``tool_calls``)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _message(item: dict, param: str) -> dict:
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise ApiError.invalid(f"{param}.role must be one of {', '.join(ROLES)}", f"{param}.role")
    if isinstance(content, list):  # the chat's text parts: each part's type named as chat names it
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                raise ApiError.invalid(f"{param}.content[{j}] is not a text part (input_text or output_text): "
                                       "this server takes text only", f"{param}.content[{j}]")
            parts.append({"type": "text", "text": part.get("text")})
        content = parts
    return {"role": role, "content": content}


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError.invalid(f"input[{i}].{key} must be a string", f"input[{i}].{key}")
    return value


def _tools(value: Any) -> Any:
    """Flat function tools as chat's nested ones; anything else goes on for chat's check."""
    if not isinstance(value, list):
        return value
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError.invalid(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function" and "function" not in value:
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(value: Any) -> Any:
    """``text``'s format as chat's ``response_format``."""
    if value is None:
        return None
    fmt = value.get("format") if isinstance(value, dict) else None
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"} or value.get("verbosity") not in (
            None, "medium"):
        raise ApiError.invalid('text must be {"format": {...}}', "text")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}
