"""xgrammar's ``format``-style structural tags as llguidance Lark grammars.

Supported format types: const_string, json_schema (style "json"), sequence, or, tag,
triggered_tags, tags_with_separator, optional, plus, star, and any_text (only where
nothing follows it: it is a greedy ``(.|\\n)*``). ``excludes`` lists, token formats and
the other styles raise ValueError (a 400 naming the type). Semantics follow xgrammar's:
triggered_tags admit free text until a trigger (a lazy lexeme: the trigger cannot appear
in the free text), ``at_least_one`` starts with a tag, ``stop_after_first`` ends after it.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

# (schema, max_whitespace_cnt) -> the schema to embed with %json (the backend's options)
SchemaHook = Callable[[Any, Optional[int]], Any]
_TEXT = "ST_TEXT"  # free text, as llguidance's own StructTag.to_grammar names it


def structural_tag_to_lark(tag: dict, prepare_schema: SchemaHook) -> str:
    builder = _Builder(prepare_schema)
    start = builder.expr(tag.get("format"))
    return "\n".join(["%llguidance {}", f"start: {start}", f"{_TEXT}: /(.|\\n)*/", *builder.rules])


def _lit(s: str) -> str:
    return json.dumps(s)  # Lark string literals take JSON escapes


class _Builder:
    def __init__(self, prepare_schema: SchemaHook) -> None:
        self.prepare_schema = prepare_schema
        self.rules: list[str] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"st_{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def expr(self, fmt: Any) -> str:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise ValueError('structural_tag formats must be objects with a "type"')
        kind = fmt["type"]
        handler = getattr(self, f"_{kind}", None)
        if handler is None:
            raise ValueError(f"llguidance does not support structural_tag format type {kind!r}")
        if fmt.get("excludes"):
            raise ValueError(f"llguidance does not support excludes in structural_tag format {kind!r}")
        return handler(fmt)

    def _const_string(self, fmt: dict) -> str:
        return _lit(_str(fmt, "value"))

    def _json_schema(self, fmt: dict) -> str:
        if fmt.get("style", "json") != "json":
            raise ValueError(f"llguidance does not support json_schema style {fmt['style']!r}")
        schema = self.prepare_schema(fmt.get("json_schema"), fmt.get("max_whitespace_cnt"))
        return self.rule("%json " + json.dumps(schema, ensure_ascii=False))

    def _any_text(self, fmt: dict) -> str:
        return _TEXT

    def _sequence(self, fmt: dict) -> str:
        return "(" + " ".join(self.expr(e) for e in _list(fmt, "elements")) + ")"

    def _or(self, fmt: dict) -> str:
        return "(" + " | ".join(self.expr(e) for e in _list(fmt, "elements")) + ")"

    def _optional(self, fmt: dict) -> str:
        return f"({self.expr(fmt.get('content'))})?"

    def _plus(self, fmt: dict) -> str:
        return f"({self.expr(fmt.get('content'))})+"

    def _star(self, fmt: dict) -> str:
        return f"({self.expr(fmt.get('content'))})*"

    def _tag(self, fmt: dict, skip: int = 0) -> str:
        """``begin content end``; ``skip``: begin characters already matched (a trigger)."""
        begin = _str(fmt, "begin")[skip:]
        ends = fmt.get("end")
        ends = [ends] if isinstance(ends, str) else ends
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise ValueError('a structural_tag "tag" needs a string (or list of strings) "end"')
        end = " | ".join(_lit(e) if e else '""' for e in ends)
        return self.rule(f"{_lit(begin) if begin else ''} {self.expr(fmt.get('content'))} ({end})")

    def _tags_with_separator(self, fmt: dict) -> str:
        one = "(" + " | ".join(self._tag(t) for t in _list(fmt, "tags")) + ")"
        many = one if fmt.get("stop_after_first") else f"{one} ({_lit(_str(fmt, 'separator'))} {one})*"
        return many if fmt.get("at_least_one") else f"({many})?"

    def _triggered_tags(self, fmt: dict) -> str:
        triggers, tags = _list(fmt, "triggers"), _list(fmt, "tags")
        calls = []  # per trigger: lazy free text up to it, then one of its tags
        for trigger in triggers:
            mine = [t for t in tags if _str(t, "begin").startswith(trigger)]
            if mine:
                head = self.rule(f"{_TEXT} {_lit(trigger)}", lazy=True)
                calls.append(f"{head} ({' | '.join(self._tag(t, len(trigger)) for t in mine)})")
        orphan = [t["begin"] for t in tags if not any(t["begin"].startswith(x) for x in triggers)]
        if orphan or not calls:
            raise ValueError(f"triggered_tags: no trigger is a prefix of begin {orphan[:1]}")
        call = self.rule(" | ".join(calls))
        if fmt.get("at_least_one"):  # xgrammar: the output starts with a tag
            first = "(" + " | ".join(self._tag(t) for t in tags) + ")"
            return first if fmt.get("stop_after_first") else f"({first} ({call})* {_TEXT})"
        if fmt.get("stop_after_first"):
            return f"({call} | {_TEXT})"
        return f"(({call})* {_TEXT})"


def _str(fmt: dict, key: str) -> str:
    value = fmt.get(key)
    if not isinstance(value, str):
        raise ValueError(f'structural_tag format {fmt.get("type")!r} needs a string "{key}"')
    return value


def _list(fmt: dict, key: str) -> list:
    value = fmt.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f'structural_tag format {fmt.get("type")!r} needs a non-empty list "{key}"')
    return value
