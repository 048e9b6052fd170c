"""The grammar of a request's tool calls, as a structural tag in xgrammar's ``format``
style (the llguidance backend translates it, constrained/structural_tag_lark.py).

- named: exactly one call of that function;
- required: one call, or several joined by the format's separator when
  ``parallel_tool_calls`` is not false; nothing else, then EOS;
- auto: free text until the trigger, then a call; after it, text again (or the end, when
  ``parallel_tool_calls`` is false).

Each call's arguments follow the function's parameters schema: exactly where a grammar
library enforces every keyword (``function.strict`` demands it), else as closely as one
can, and the frontend validates each completed call against the full schema
(srt/frontend/document_check.py). The part carries the function's name for messages.
"""
from __future__ import annotations

from typing import Optional

from constrained.schema_coverage import with_strict
from constrained.tag_parts import NAME_KEY
from srt.function_call.formats import ToolCallFormat
from srt.function_call.tools import ToolRequest, ToolSpec


def _call_tag(fmt: ToolCallFormat, tool: ToolSpec, max_whitespace: Optional[int]) -> dict:
    schema = {**tool.parameters, NAME_KEY: tool.name}
    content = {"type": "json_schema", "json_schema": with_strict(schema, tool.strict)}
    if max_whitespace:  # --constrained-json-max-whitespace: a weak model cannot loop on spaces
        content["max_whitespace_cnt"] = max_whitespace
    return {"type": "tag", "begin": fmt.begin + tool.name + fmt.args_begin, "content": content, "end": fmt.end}


def tool_call_structural_tag(req: ToolRequest, fmt: ToolCallFormat,
                             max_whitespace: Optional[int] = None) -> Optional[dict]:
    """The ``structural_tag`` constraint for ``req``, or None when it calls no tools."""
    if not req.active:
        return None
    tags = [_call_tag(fmt, t, max_whitespace) for t in req.tools]
    if req.mode == "named":
        body = tags[0]
    elif req.mode == "required":
        body = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                "at_least_one": True, "stop_after_first": not req.parallel}
    else:
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                "stop_after_first": not req.parallel}
    return {"type": "structural_tag", "format": body}
