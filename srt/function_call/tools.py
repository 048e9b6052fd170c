"""Validation of OpenAI ``tools`` / ``tool_choice`` (each error names the bad field) and
the resolved request: which tools, which mode."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

# OpenAI's rule for function names (plus dots). It also keeps names literal in grammars
# and JSON: no quotes, backslashes or control characters to escape.
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MODES = ("none", "auto", "required")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters = none


class ToolCallError(ValueError):
    """A user error about tools; ``param`` is the OpenAI error's ``param`` field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def check_tools(tools: Optional[list]) -> Optional[list[dict]]:
    """Raise ValueError naming the entry and key at fault; return ``tools`` unchanged."""
    if tools is None:
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f'{where}.type must be "function" (the only tool type supported)')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        unknown = sorted(set(tool) - {"type", "function"}) + sorted(
            f"function.{k}" for k in set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ValueError(f"{where} has unknown field(s): {', '.join(unknown)}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1-64 characters from a-z, A-Z, 0-9, "
                             f"'_', '-' and '.', got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is not unique: names must differ")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
    return tools


def check_tool_choice(choice: Any, tools: Optional[list]) -> Any:
    """Raise ValueError for an unknown mode, a named function not in ``tools``, or a
    choice that needs tools when there are none; return ``choice`` unchanged."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in _MODES:
            raise ValueError(f'tool_choice must be "none", "auto", "required" or '
                             f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}')
        if choice == "required" and not tools:
            raise ValueError('tool_choice "required" needs a non-empty tools list')
        return choice
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError('a named tool_choice must be {"type": "function", "function": {"name": ...}}')
    known = [t["function"]["name"] for t in tools or []]
    if fn["name"] not in known:
        raise ValueError(f"tool_choice names function {fn['name']!r}, which is not in tools "
                         f"(known: {', '.join(known) or 'none'})")
    return choice


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict  # JSON schema of the arguments object
    strict: bool = False  # OpenAI's function.strict: an exact grammar or a 400


@dataclass(frozen=True)
class ToolRequest:
    """A request's resolved tool use. ``mode``: none (plain text, tools not shown),
    auto, required, or named (``tools`` is then just that function)."""

    mode: str
    tools: tuple[ToolSpec, ...]
    parallel: bool  # parallel_tool_calls (OpenAI's default: true)
    shown: tuple[dict, ...]  # the request's tool entries, as the prompt shows them

    @property
    def active(self) -> bool:
        return self.mode != "none"


def resolve(tools: Optional[list], choice: Any, parallel: Optional[bool]) -> ToolRequest:
    """The checked ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of one request.
    Default choice: auto with tools, none without (OpenAI)."""
    tools = tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or not tools:
        return ToolRequest("none", (), bool(parallel is not False), ())
    specs = tuple(ToolSpec(t["function"]["name"], t["function"].get("parameters") or _EMPTY_PARAMETERS,
                           t["function"].get("strict") is True) for t in tools)
    mode = choice if isinstance(choice, str) else "named"
    if mode == "named":
        specs = tuple(s for s in specs if s.name == choice["function"]["name"])
    return ToolRequest(mode, specs, parallel is not False, tuple(tools))
