"""Tool-call arguments in the styles a structural-tag part may be written in: ``json``,
``qwen_xml`` (Qwen3-Coder / Qwen3.5: ``<parameter=KEY>\\nVALUE\\n</parameter>``, strings
raw) and ``pythonic`` (Llama 3.2 / 4: ``f(a=1, b="x")``'s keyword arguments).

Where a part's arguments end in the output (``ArgScanner``, fed incrementally), and the
arguments rebuilt as JSON text by the schema's types (``to_json_arguments``), so that
every style is validated against the full schema exactly as JSON arguments are.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from constrained.pythonic_args import parse_calls
from constrained.qwen_xml_args import parse_parameters


class ArgScanner:
    """Feed the text after ``args_begin``; ``feed(buf)`` -> (characters of ``buf`` that
    belong to the arguments, or None when they cannot be arguments; whether they ended).
    Not taken: the tail that may begin ``call_end`` (qwen_xml) and what follows."""

    def __init__(self, style: str, call_end: str) -> None:
        self.style, self.call_end = style, call_end
        self.text = ""  # the arguments so far
        self._depth, self._quote, self._esc, self._started = 0, "", False, False

    def feed(self, buf: str) -> tuple[Optional[int], bool]:
        if self.style == "qwen_xml":
            return self._until_end(buf)
        start = 0
        if self.style == "json" and not self._started:  # whitespace, then an object or list
            start = len(buf) - len(buf.lstrip())
            if start == len(buf):
                return start, False
            if buf[start] not in "{[":
                return None, False
            self._started = True
        quotes = "\"'" if self.style == "pythonic" else '"'
        for i in range(start, len(buf)):
            c = buf[i]
            if self._quote:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == self._quote:
                    self._quote = ""
            elif c in quotes:
                self._quote = c
            elif c in "{[(":
                self._depth += 1
            elif c in "}])":
                if self.style == "pythonic" and self._depth == 0:  # the call's own ")"
                    self.text += buf[:i]
                    return i, True
                self._depth -= 1
                if self._depth < 0:
                    return None, False
                if self._depth == 0 and self.style == "json":
                    self.text += buf[:i + 1]
                    return i + 1, True
        self.text += buf
        return len(buf), False

    def _until_end(self, buf: str) -> tuple[Optional[int], bool]:
        joined = self.text + buf
        at = joined.find(self.call_end, max(0, len(self.text) - len(self.call_end)))
        if at >= 0:
            taken = at - len(self.text)
            self.text = joined[:at]
            return taken, True
        keep = len(buf)
        for k in range(min(len(self.call_end) - 1, len(joined)), 0, -1):
            if self.call_end.startswith(joined[-k:]):
                keep = max(0, len(buf) - k)
                break
        self.text += buf[:keep]
        return keep, False


def to_json_arguments(style: str, text: str, name: str, schema: Any) -> Optional[str]:
    """The arguments as JSON text (None: not arguments of this style)."""
    if style == "json":
        return text
    try:
        if style == "qwen_xml":
            args = parse_parameters(text, schema if isinstance(schema, dict) else {})
        else:
            calls = parse_calls(f"[{name}({text})]")
            if len(calls) != 1:
                return None
            args = calls[0][1]
    except (ValueError, SyntaxError, RecursionError):
        return None
    return json.dumps(args, ensure_ascii=False)


def decode_document(style: str, text: str, start: int, name: str, schema: Any,
                    ends: tuple[str, ...]) -> Optional[tuple[str, int]]:
    """(the part's arguments as JSON text, where they stop in ``text``) for a part whose
    arguments begin at ``start``; None when no whole arguments are there."""
    if style == "json":
        try:
            _, stop = json.JSONDecoder().raw_decode(text, start)
        except (ValueError, RecursionError):
            return None
        return text[start:stop], stop
    scan = ArgScanner(style, ends[0] if ends else "")
    taken, done = scan.feed(text[start:])
    if taken is None or not done:
        return None
    args = to_json_arguments(style, scan.text, name, schema)
    return None if args is None else (args, start + taken)
