"""The head's side of tool calls: render the offered functions through the chat template,
pick the family's call syntax from the template, and constrain the reply with a grammar when
the request requires a call.

History in OpenAI's shape (an assistant's ``tool_calls`` with ``arguments`` as JSON text,
``tool`` messages) is handed to the template in the shape templates read (``arguments`` an
object), as vLLM does.

A template that does not read ``tools`` (SmolLM2's, many small models') would drop them without
a word. There the head writes the tools into the system message itself, in the hermes wording
Qwen 2.5's template uses, turns earlier calls into ``<tool_call>`` text and tool results into
``<tool_response>`` turns of the user, and parses and constrains the reply as hermes: what
llama.cpp's server does for such templates with its generic format.
"""
from __future__ import annotations

import dataclasses
import json

from ..toolcalls.grammar import call_grammar
from ..toolcalls.syntax import HERMES, Syntax, detect, renders_tools
from ..wire.protocol import Generate, ToolChoice


def template_source(tokenizer) -> str:
    """The template transformers renders a chat with tools by (a dict of named templates
    offers "tool_use", else "default")."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def syntax_of(tokenizer, req: Generate) -> Syntax | None:
    """The call syntax of ``req``'s reply, or None when it offers no tools: the template's own,
    or hermes where the head writes the tools itself (:func:`chat_input`)."""
    if req.tools is None:
        return None
    source = template_source(tokenizer)
    return detect(source) if renders_tools(source) else HERMES


def chat_input(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to hand the chat template: as the template reads them, or, where it
    does not read ``tools``, the tools written into the messages (and None for the template)."""
    messages = template_messages(messages)
    if tools is None or renders_tools(template_source(tokenizer)):
        return messages, tools
    return generic_messages(messages, tools), None


def tool_syntax(req: Generate, syntax: Syntax | None) -> str:
    """What the start event tells the client to parse the reply by: "" with no tools, or
    ``tool_choice`` "none" (the reply is text, whatever it looks like)."""
    return syntax.name if syntax is not None and req.tools.choice != ToolChoice.NONE else ""


def constrained(tokenizer, req: Generate, syntax: Syntax | None) -> Generate:
    """``req`` with the grammar of a reply of calls when ``tool_choice`` requires one."""
    if syntax is None or not req.tools.requires_call:
        return req
    return dataclasses.replace(req, grammar=call_grammar(req.tools, syntax, _special(tokenizer, syntax.opening)))


def _special(tokenizer, text: str) -> str:
    """``text`` as llguidance names a special token (``<[id]>``) when the tokenizer has it as
    one, so the grammar asks for that token; "" when it is ordinary text."""
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if text and added.content == text and added.special:
            return f"<[{token_id}]>"
    return ""


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI's messages in the shape chat templates read: a call's ``arguments`` an object
    (JSON text that is no object stays as it is), null content an empty string."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [_readable(call) for call in m["tool_calls"]]
        out.append(m)
    return out


def _readable(call: dict) -> dict:
    function = dict(call["function"])
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = None
    if isinstance(arguments, dict):
        function["arguments"] = arguments
    return {**call, "function": function}


GENERIC_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def generic_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` (as :func:`template_messages` gives them) with ``tools`` in the system message,
    calls as hermes text and tool results as the user's ``<tool_response>`` turns (consecutive
    results in one turn), for a template that knows only roles and content."""
    block = GENERIC_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict] = []
    results = False  # the last turn holds tool results
    for m in messages:
        if m.get("role") == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            results = True
            continue
        results = False
        calls = [_hermes_call(call) for call in m.get("tool_calls") or ()]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + calls)
        out.append(m)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}"}, *out[1:]]
    return [{"role": "system", "content": block}, *out]


def _hermes_call(call: dict) -> str:
    """One call of the history (its ``arguments`` an object, or text) as hermes writes it."""
    function = call.get("function", {})
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return f"{HERMES.opening}\n{json.dumps(body, ensure_ascii=False)}\n{HERMES.closing}"
