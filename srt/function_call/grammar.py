"""The grammar of a request's tool calls, as a structural tag in xgrammar's ``format``
style (the llguidance backend translates the JSON-argument ones, constrained/structural_tag_lark.py).

- named: exactly one call of that function;
- required: one call, or several (joined by the format's separator, inside its wrapper)
  when ``parallel_tool_calls`` is not false; nothing else, then EOS;
- auto: free text until the trigger, then the calls; after them, text again (or the end,
  when ``parallel_tool_calls`` is false).

``auto`` and named are xgrammar's built-in structural tag for the family where it has one
(``ToolCallFormat.builtin``: Hermes, Qwen3-Coder, Llama 3, DeepSeek V3 / V3.1), tag for tag:
tests/test_tool_formats.py compares them with ``xgrammar.get_model_structural_tag``'s. They
are written out here rather than asked of xgrammar at run time because importing xgrammar
loads torch (~5 s, ~280 MB), and the frontend process, which builds the tag, stays without
it. ``required`` is ours: the built-ins' ``required`` is a triggered tag that lets free text
sit between and after the calls, and ours promises calls and nothing else. Mistral and the
pythonic list have no built-in in xgrammar 0.2.9.

Each call's arguments follow the function's parameters schema: exactly where a grammar
library enforces every keyword (``function.strict`` demands it), else as closely as one
can, and the frontend validates each completed call against the full schema
(srt/frontend/document_check.py). The part carries the function's name for messages and
its ``style`` (json, qwen_xml, pythonic: constrained/tag_parts.py).
"""
from __future__ import annotations

from typing import Optional

from constrained.pythonic_args import kwargs_grammar, render_calls
from constrained.schema_coverage import with_strict
from constrained.tag_parts import NAME_KEY
from srt.function_call.formats import ToolCallFormat
from srt.function_call.tools import ToolCallError, ToolRequest, ToolSpec


def _schema(tool: ToolSpec) -> dict:
    return with_strict({**tool.parameters, NAME_KEY: tool.name}, tool.strict)


def _args(fmt: ToolCallFormat, tool: ToolSpec, max_whitespace: Optional[int]) -> dict:
    content = {"type": "json_schema", "json_schema": _schema(tool)}
    if fmt.args_style != "json":
        content["style"] = fmt.args_style
    if max_whitespace:  # --constrained-json-max-whitespace: a weak model cannot loop on spaces
        content["max_whitespace_cnt"] = max_whitespace
    return content


def _call(fmt: ToolCallFormat, tool: ToolSpec, ws: Optional[int], head: str = "", tail: str = "") -> dict:
    return {"type": "tag", "begin": head + fmt.call_begin + tool.name + fmt.args_begin,
            "content": _args(fmt, tool, ws), "end": fmt.call_end + tail}


def _pythonic_auto(fmt: ToolCallFormat, req: ToolRequest, ws: Optional[int]) -> dict:
    """Triggered by ``[NAME(`` per tool, not by ``[`` alone (which prose writes all the time):
    the first call's tag holds the rest of the list."""
    others = {"type": "or", "elements": [_call(fmt, t, ws) for t in req.tools]}
    more = {"type": "star", "content": {"type": "sequence", "elements": [
        {"type": "const_string", "value": fmt.separator}, others]}}
    tags = []
    for t in req.tools:
        rest = [{"type": "const_string", "value": fmt.call_end}] + ([more] if req.parallel else [])
        tags.append({"type": "tag", "begin": fmt.calls_begin + t.name + fmt.args_begin,
                     "content": {"type": "sequence", "elements": [_args(fmt, t, ws), *rest]},
                     "end": fmt.calls_end})
    return {"type": "triggered_tags", "triggers": [tag["begin"] for tag in tags], "tags": tags,
            "stop_after_first": not req.parallel}


def tool_call_structural_tag(req: ToolRequest, fmt: ToolCallFormat,
                             max_whitespace: Optional[int] = None) -> Optional[dict]:
    """The ``structural_tag`` constraint for ``req``, or None when it calls no tools."""
    if not req.active:
        return None
    ws = max_whitespace
    if req.mode == "named":
        body = _call(fmt, req.tools[0], ws, fmt.calls_begin, fmt.calls_end)
    elif fmt.args_style == "pythonic" and req.mode == "auto":
        body = _pythonic_auto(fmt, req, ws)
    else:
        calls = {"type": "tags_with_separator", "tags": [_call(fmt, t, ws) for t in req.tools],
                 "separator": fmt.separator, "at_least_one": True, "stop_after_first": not req.parallel}
        if fmt.wrapped:
            calls = {"type": "tag", "begin": fmt.calls_begin, "content": calls, "end": fmt.calls_end}
        if req.mode == "auto":
            calls = calls if fmt.wrapped else {**calls, "at_least_one": False}
            body = {"type": "triggered_tags", "triggers": [fmt.auto_trigger or fmt.trigger],
                    "tags": [calls] if fmt.wrapped else calls["tags"], "stop_after_first": not req.parallel}
        else:
            body = calls
    return {"type": "structural_tag", "format": body}


def check_writable(req: ToolRequest, fmt: ToolCallFormat) -> None:
    """A 400 naming the tool when the format cannot write its calls (pythonic: a name or a
    parameter Python cannot spell), before any grammar is compiled on the ranks."""
    if fmt.args_style != "pythonic" or not req.active:
        return
    names = [t["function"]["name"] for t in req.shown]
    for tool in req.tools:
        try:
            render_calls([(tool.name, {})])
            kwargs_grammar(tool.parameters)
        except ValueError as e:
            raise ToolCallError(f"tools[{names.index(tool.name)}] ({tool.name}): the pythonic tool-call format "
                                f"cannot write its calls: {e}", "tools") from None
