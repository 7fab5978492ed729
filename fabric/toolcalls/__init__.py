"""Tool calls: how a chat template's family writes a call (``syntax``), the grammar that
constrains a reply to calls (``grammar``), and the parser that turns a reply's text back into
OpenAI's ``tool_calls`` (``parse``), whole or as it streams.

Pure Python over JSON: the head picks the syntax and builds the grammar (it has the template
and the tokenizer), the web UI and scripts parse the text the head streams.
"""
from .parse import CallStream, Content, ToolCall, parse_reply
from .syntax import SYNTAXES, Syntax, detect, renders_tools

__all__ = ["CallStream", "Content", "SYNTAXES", "Syntax", "ToolCall", "detect", "parse_reply", "renders_tools"]
