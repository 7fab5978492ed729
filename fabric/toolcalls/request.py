"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as one ``protocol.Tools``,
checked as the head will check it; shared by the web UI and the scripting client."""
from __future__ import annotations

from typing import Any

from ..wire.protocol import ProtocolError, ToolChoice, Tools


class ToolsError(ValueError):
    """A tools field the request got wrong; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def tools_of(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> Tools | None:
    """The ``Tools`` a request asks for; None when it offers none (a ``tool_choice`` of "none"
    or "auto" then asks for nothing). A ``Tools`` passes as it is."""
    if isinstance(tools, Tools):
        return tools
    choice, name = _choice(tool_choice)
    if tools is None or tools == []:
        if choice in (ToolChoice.REQUIRED, ToolChoice.FUNCTION):
            raise ToolsError("tool_choice", "a required or named call needs tools")
        return None
    if not isinstance(tools, (list, tuple)):
        raise ToolsError("tools", "must be an array of functions")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolsError("parallel_tool_calls", "must be a boolean")
    found = Tools(tuple(tools), choice, name, True if parallel_tool_calls is None else parallel_tool_calls)
    try:
        found.validate()
    except ProtocolError as exc:
        raise ToolsError("tool_choice" if "tool_choice" in str(exc) else "tools", str(exc)) from None
    return found


def _choice(value: Any) -> tuple[str, str]:
    """(choice, function name) of OpenAI's ``tool_choice``: "auto", "none", "required" or
    ``{"type": "function", "function": {"name": ...}}``."""
    if value is None:
        return ToolChoice.AUTO, ""
    if isinstance(value, str) and value in (ToolChoice.AUTO, ToolChoice.NONE, ToolChoice.REQUIRED):
        return ToolChoice(value), ""
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]:
        return ToolChoice.FUNCTION, function["name"]
    raise ToolsError("tool_choice", 'must be "auto", "none", "required" or {"type": "function", '
                     '"function": {"name": ...}}')
