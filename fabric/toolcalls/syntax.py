"""How each model family writes a tool call, and which one a chat template uses.

A template that renders tools also teaches the model its family's call syntax; the head reads
the template's source once and picks the syntax from a small table (first match wins):

- hermes (Qwen 2.5/3, Hermes, many fine-tunes): ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>``,
  one block per call, a newline between blocks;
- mistral: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ...]``, one array of calls;
- llama3 (Llama 3.1+): a bare JSON object ``{"name": .., "parameters": {..}}``; several are
  separated by ``; `` (as vLLM's llama3_json parser reads them).

A template that shows tools but matches no row gets hermes, the most widely trained syntax.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Syntax:
    name: str
    opening: str  # text that opens a call (hermes) or the calls (mistral); "" for a bare JSON object
    closing: str  # text that closes one call; "": the calls run to the end of the reply
    arguments: str  # the key of a call's arguments: "arguments" or "parameters"
    separator: str = ""  # between two calls (hermes, llama3); mistral's calls share one array
    array: bool = False  # the calls are one JSON array (mistral)


HERMES = Syntax("hermes", "<tool_call>", "</tool_call>", "arguments", separator="\n")
MISTRAL = Syntax("mistral", "[TOOL_CALLS]", "", "arguments", array=True)
LLAMA3 = Syntax("llama3", "", "", "parameters", separator="; ")
SYNTAXES = {s.name: s for s in (HERMES, MISTRAL, LLAMA3)}

# (text in the template's source, the syntax it writes), in order
DETECTION = (
    ("<tool_call>", HERMES),
    ("[TOOL_CALLS]", MISTRAL),
    ("<|python_tag|>", LLAMA3),
    ("<|start_header_id|>", LLAMA3),
)
DEFAULT = HERMES


def renders_tools(template: object) -> bool:
    """Whether a chat template (its source, or a dict of named ones) reads ``tools`` at all:
    one that does not would drop them without a word."""
    sources = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(s, str) and "tools" in s for s in sources)


@functools.lru_cache(maxsize=64)
def detect(template: str) -> Syntax:
    """The call syntax ``template`` writes (logged once per template)."""
    for marker, syntax in DETECTION:
        if marker in template:
            log.info("tool calls: the chat template holds %r: parsing and constraining calls as %s",
                     marker, syntax.name)
            return syntax
    log.info("tool calls: the chat template names no known call syntax: using %s", DEFAULT.name)
    return DEFAULT
