"""The glue between the chat handler and this package: one ``ToolCalling`` per request
prepares the template input and the constraint, then turns the output into OpenAI's
``tool_calls`` (whole, or as stream deltas)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from constrained.strict_check import check_strict
from constrained.tag_plan import StrictPartError
from sampling.sampling_params import CONSTRAINT_FIELDS
from srt.managers.document_check import json_options
from srt.function_call.formats import ToolCallFormat, get_format
from srt.function_call.grammar import tool_call_structural_tag
from srt.function_call.parser import Delta, ToolCallParser
from srt.function_call.prompt import prepare_messages, template_supports_tools
from srt.function_call.tools import ToolCallError, ToolRequest, resolve


@dataclass(frozen=True)
class ToolCalling:
    req: ToolRequest
    fmt: ToolCallFormat
    constraint: Optional[dict]

    @classmethod
    def prepare(cls, body, messages: list[dict], tokenizer, server_args) -> tuple["ToolCalling", list[dict], dict]:
        """(this request's tool calling, messages for the template, template kwargs)."""
        fmt = get_format(getattr(server_args, "tool_call_parser", None))
        req = resolve(body.tools, body.tool_choice, body.parallel_tool_calls)
        msgs, kwargs = prepare_messages(messages, req, fmt, template_supports_tools(tokenizer))
        max_ws = getattr(server_args, "constrained_json_max_whitespace", 0) or None
        tools = cls(req, fmt, tool_call_structural_tag(req, fmt, max_ws))
        tools.check_strict(server_args)
        return tools, msgs, kwargs

    def check_strict(self, server_args) -> None:
        """A tool with ``function.strict: true`` that no grammar serves exactly is a 400 naming
        the tool, the keyword and its path, before any byte is sent (tag_plan.py)."""
        if self.constraint is None or not any(t.strict for t in self.req.tools):
            return
        try:
            check_strict(None, json.dumps(self.constraint), server_args.grammar_backend,
                         json_options(server_args))
        except StrictPartError as e:
            index = [t["function"]["name"] for t in self.req.shown].index(e.part.name)
            reason = str(e).split(": ", 1)[1]
            raise ToolCallError(f"tools[{index}] ({e.part.name}): function.{reason}", "tools") from None

    @staticmethod
    def prompt_chars(messages: list[dict], template_kwargs: dict) -> int:
        """Characters certain to reach the prompt: message contents, the history's calls and
        the tools list (README "Tool calling"): the pre-tokenize length check counts them all."""
        chars = 0
        for m in messages:
            chars += len(m["content"]) if isinstance(m.get("content"), str) else 0
            for call in m.get("tool_calls") or ():
                fn = call.get("function", {})
                chars += len(fn.get("name", "")) + len(json.dumps(fn.get("arguments", ""), ensure_ascii=False))
        if template_kwargs.get("tools"):
            chars += len(json.dumps(template_kwargs["tools"], ensure_ascii=False))
        return chars

    def constrain(self, sampling_params: dict) -> None:
        """Add the tool-call grammar to the request's sampling params (in place)."""
        if self.constraint is None:
            return
        other = [k for k in CONSTRAINT_FIELDS if sampling_params.get(k) is not None]
        if other:
            raise ToolCallError(
                f"tool_choice {self.req.mode!r} constrains the output to the tools' calls, so it cannot "
                f"be combined with another constraint ({other[0]}, from response_format, regex, ebnf, "
                "choice or structured_outputs): drop that field, or send tool_choice \"none\"",
                "tool_choice")
        sampling_params["structural_tag"] = self.constraint

    def message(self, text: str, reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """(ChatMessageOut fields, finish_reason) of a finished output. A call cut short
        (max_tokens) stays in the content, as text."""
        if not self.req.active:
            return {"content": text}, reason
        if reason == "schema_violation":  # a call broke its tool's schema: none is returned as a call
            return {"content": text}, reason
        parser = ToolCallParser(self.fmt)
        parser.feed(text)
        parser.finish()
        calls = parser.complete_calls
        content = parser.content + "".join(c.raw for c in parser.calls if not c.complete)
        fields: dict[str, Any] = {"content": content if content.strip() or not calls else None}
        if calls:
            fields["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return fields, _finish_reason(reason, bool(calls))

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(ToolCallParser(self.fmt) if self.req.active else None)


class ToolCallStream:
    """Text deltas -> DeltaMessage fields (content and OpenAI's tool-call deltas)."""

    def __init__(self, parser: Optional[ToolCallParser]) -> None:
        self.parser = parser

    def deltas(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return _messages(self.parser.feed(text))

    def finish(self, reason: Optional[str]) -> tuple[list[dict[str, Any]], Optional[str]]:
        """(the last deltas, the finish_reason to send)."""
        if self.parser is None:
            return [], reason
        out = _messages(self.parser.finish())
        return out, _finish_reason(reason, bool(self.parser.complete_calls))


def _finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and reason == "stop" else reason


def _messages(delta: Delta) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"content": delta.content}] if delta.content else []
    for index, call_id, name, args in delta.calls:
        if call_id is not None:  # the call's first delta
            item = {"index": index, "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
        else:
            item = {"index": index, "function": {"arguments": args}}
        out.append({"tool_calls": [item]})
    return out
