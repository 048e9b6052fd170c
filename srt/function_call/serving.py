"""The glue between the chat handler and this package: one ``ToolCalling`` per request
prepares the template input and the constraint, then turns the output into OpenAI's
``tool_calls`` (whole, or as stream deltas)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from constrained.schema_coverage import needs_format_check
from constrained.grammar_config import JsonOptions
from constrained.tag_parts import tag_parts
from constrained.tag_plan import StrictPartError, plan_tag
from sampling.sampling_params import CONSTRAINT_FIELDS
from srt.function_call.format_choice import format_for
from srt.function_call.formats import ToolCallFormat
from srt.function_call.grammar import check_writable, tool_call_structural_tag
from srt.function_call.parser import Delta, ToolCallParser
from srt.function_call.prompt import prepare_messages, template_supports_tools
from srt.function_call.tools import ToolCallError, ToolRequest, resolve


@dataclass(frozen=True)
class ToolCalling:
    req: ToolRequest
    fmt: ToolCallFormat
    constraint: Optional[dict]
    # Tools whose calls a stream holds back until they are complete and validated: the
    # grammar serving them is approximate (or checks a format's syntax only), so a call
    # could break its schema; exact tools' arguments stream as they are generated.
    held: frozenset = frozenset()
    # The format's markers hold a special token of the tokenizer (Mistral's [TOOL_CALLS]):
    # the output is decoded with special tokens kept, or the parser would never see them.
    keep_special: bool = False

    @classmethod
    def prepare(cls, body, messages: list[dict], tokenizer, server_args,
                check_size: Optional[Callable[[int], None]] = None) -> tuple["ToolCalling", list[dict], dict]:
        """(this request's tool calling, messages for the template, template kwargs).
        ``check_size(prompt_chars(...))`` runs before the grammar is built, so a prompt that
        cannot fit costs no schema analysis."""
        fmt = format_for(server_args, tokenizer)
        req = resolve(body.tools, body.tool_choice, body.parallel_tool_calls)
        backend = getattr(server_args, "grammar_backend", None)
        if req.active and backend == "none":  # never a silent "auto": nothing could enforce the calls
            raise ToolCallError(f"tool_choice {req.mode!r} cannot be enforced in the {fmt.name} tool-call format: "
                                "this server runs --grammar-backend none (no grammar); send tool_choice "
                                "\"none\" or restart it with a grammar backend", "tool_choice")
        if req.active and fmt.args_style != "json" and backend == "llguidance":
            raise ToolCallError(f"the {fmt.name} tool-call format writes {fmt.args_style} arguments, which only "
                                "the xgrammar grammar backend can constrain: this server runs --grammar-backend "
                                "llguidance (use auto or xgrammar)", "tool_choice")
        msgs, kwargs = prepare_messages(messages, req, fmt, template_supports_tools(tokenizer))
        if check_size is not None:
            check_size(cls.prompt_chars(msgs, kwargs))
        max_ws = getattr(server_args, "constrained_json_max_whitespace", 0) or None
        check_writable(req, fmt)
        constraint = tool_call_structural_tag(req, fmt, max_ws)
        held = _held_tools(req, constraint, server_args)
        if fmt.args_style != "json":  # rebuilt as JSON only once whole: a call streams in one piece
            held = frozenset(t.name for t in req.tools)
        return cls(req, fmt, constraint, held, req.active and _marks_special(fmt, tokenizer)), msgs, kwargs

    @staticmethod
    def prompt_chars(messages: list[dict], template_kwargs: dict) -> int:
        """Characters certain to reach the prompt: message contents, the history's calls and
        the tools list (docs/tools.md): the pre-tokenize length check counts them all."""
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
        if self.keep_special:
            sampling_params["skip_special_tokens"] = False

    def message(self, text: str, reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """(ChatMessageOut fields, finish_reason) of a finished output. A call cut short
        (max_tokens) stays in the content, as text."""
        if not self.req.active:
            return {"content": text}, reason
        if reason == "schema_violation":  # a call broke its tool's schema: none is returned as a call
            return {"content": text}, reason
        parser = ToolCallParser(self.fmt, self.schemas)
        parser.feed(text)
        parser.finish()
        calls = parser.complete_calls
        content = parser.content + "".join(c.raw for c in parser.calls if not c.complete)
        fields: dict[str, Any] = {"content": content if content.strip() or not calls else None}
        if calls:
            fields["tool_calls"] = [{"id": c.id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return fields, _finish_reason(reason, bool(calls))

    def stream(self, validate: Optional[Callable[[str, str], bool]] = None) -> "ToolCallStream":
        """``validate(schema_text, arguments)``: does a completed call satisfy its schema?"""
        if not self.req.active:
            return ToolCallStream(None)
        held = {t.name: json.dumps(t.parameters) for t in self.req.tools if t.name in self.held} if validate else {}
        return ToolCallStream(ToolCallParser(self.fmt, self.schemas), held, validate)

    @property
    def schemas(self) -> dict[str, dict]:
        """Each tool's parameters: arguments not written as JSON are rebuilt by their types."""
        return {t.name: t.parameters for t in self.req.tools}


class ToolCallStream:
    """Text deltas -> DeltaMessage fields (content and OpenAI's tool-call deltas). A call of
    a held tool is sent whole once it is complete and valid; an invalid one is never sent as
    a call (its text goes to content; the last chunk says ``schema_violation``)."""

    def __init__(self, parser: Optional[ToolCallParser], held: Optional[dict] = None,
                 validate: Optional[Callable[[str, str], bool]] = None) -> None:
        self.parser = parser
        self.held, self.validate = held or {}, validate
        self.pending: set[int] = set()  # indices of held calls not yet released

    def deltas(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._hold(self.parser.feed(text))

    def finish(self, reason: Optional[str]) -> tuple[list[dict[str, Any]], Optional[str]]:
        """(the last deltas, the finish_reason to send)."""
        if self.parser is None:
            return [], reason
        out = self._hold(self.parser.finish())
        for index in sorted(self.pending):  # cut short: its text is content, as unstreamed
            out.append({"content": self.parser.calls[index].raw})
        self.pending.clear()
        return out, _finish_reason(reason, bool(self.parser.complete_calls))

    def _hold(self, delta: Delta) -> list[dict[str, Any]]:
        passed = Delta(delta.content)
        for index, call_id, name, args in delta.calls:
            if self.parser.calls[index].name in self.held:
                self.pending.add(index)
            else:
                passed.calls.append((index, call_id, name, args))
        out = _messages(passed)
        for index in sorted(self.pending):
            call = self.parser.calls[index]
            if not call.complete:
                continue
            self.pending.discard(index)
            if self.validate(self.held[call.name], call.arguments):
                out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": call.arguments}}]})
            else:
                out.append({"content": call.raw})
        return out


def _held_tools(req: ToolRequest, constraint: Optional[dict], server_args) -> frozenset:
    """The tools' plan (tag_plan.py), made once per request: a ``function.strict`` tool no
    grammar serves exactly is a 400 naming the tool, the keyword and its path, before any
    byte is sent; the names returned are the tools whose calls may break their schema."""
    if constraint is None or server_args is None:
        return frozenset()
    parts = tag_parts(constraint)
    if server_args.grammar_backend not in ("xgrammar", "llguidance", "auto"):
        return frozenset(p.name for p in parts)  # a plugin's grammars count as approximate
    try:
        plan = plan_tag(parts, server_args.grammar_backend, JsonOptions.from_server_args(server_args))
    except StrictPartError as e:
        index = [t["function"]["name"] for t in req.shown].index(e.part.name)
        reason = str(e).split(": ", 1)[1]
        raise ToolCallError(f"tools[{index}] ({e.part.name}): function.{reason}", "tools") from None
    except ValueError:  # llguidance refuses a schema outright: the rank says why
        return frozenset(p.name for p in parts)
    inexact = {g.rsplit(" in ", 1)[1] for g in plan.gaps}
    return frozenset(p.name for p in parts if p.name in inexact or needs_format_check(json.dumps(p.schema)))


def _marks_special(fmt: ToolCallFormat, tokenizer) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {t.content for t in added.values() if getattr(t, "special", False)}
    specials = [t for t in specials | set(getattr(tokenizer, "all_special_tokens", None) or ()) if len(t) > 1]
    marks = [fmt.calls_begin, fmt.call_begin, fmt.args_begin, fmt.call_end, fmt.calls_end]
    return any(s in m for s in specials for m in marks if m)


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
