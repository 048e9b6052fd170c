"""The glue between the chat handler and this package: one ``ToolCalling`` per request
prepares the template input and the constraint, then turns the output into OpenAI's
``tool_calls`` (whole, or as stream deltas)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sampling.sampling_params import CONSTRAINT_FIELDS
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
        return cls(req, fmt, tool_call_structural_tag(req, fmt, max_ws)), msgs, kwargs

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
