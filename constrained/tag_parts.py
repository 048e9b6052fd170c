"""The JSON-schema parts of a structural tag (tool calls are one): where each sits in the
tag, the library copy of the tag, and each completed part found again in the output.

A part's schema may carry two root keywords of ours, stripped before any library sees it:
``x-gramsync-strict`` (OpenAI's ``function.strict``: exact or a 400) and
``x-gramsync-name`` (how messages name the part: the tool's name). A part is the content
of a ``tag`` (found in the output after its ``begin``; these are validated at finish) or a
``json_schema`` elsewhere (not found again in the output, so it must be served exactly).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from constrained.arg_styles import decode_document
from constrained.pythonic_args import kwargs_grammar
from constrained.schema_coverage import STRICT_KEY

ARG_STYLES = ("json", "qwen_xml", "pythonic")

NAME_KEY = "x-gramsync-name"
_WS = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class TagPart:
    index: int  # order of the part in the tag
    name: str  # the part's x-gramsync-name, else "tag <index>"
    begin: Optional[str]  # the text right before its JSON; None: outside a tag
    ends: tuple[str, ...]
    schema: Any  # without our keywords
    strict: bool
    max_whitespace: Optional[int] = None  # the json_schema format's max_whitespace_cnt
    style: str = "json"  # how the arguments are written: constrained/arg_styles.py

    @property
    def must_be_exact(self) -> bool:
        return self.strict or self.begin is None


def _clean(schema: Any) -> tuple[Any, bool, Optional[str]]:
    if not isinstance(schema, dict) or not ({STRICT_KEY, NAME_KEY} & set(schema)):
        return schema, False, None
    rest = {k: v for k, v in schema.items() if k not in (STRICT_KEY, NAME_KEY)}
    name = schema.get(NAME_KEY)
    return rest, schema.get(STRICT_KEY) is True, name if isinstance(name, str) else None


def _ends(value: Any) -> tuple[str, ...]:
    ends = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return tuple(e for e in ends if isinstance(e, str))


def _walk(fmt: Any, found: list, begin: Optional[str] = None, ends: tuple[str, ...] = ()) -> None:
    """Collect (schema node holder, begin, ends) for every json_schema format, in order."""
    if isinstance(fmt, list):
        for f in fmt:
            _walk(f, found)
        return
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind == "json_schema":
        found.append((fmt, "json_schema", begin, ends))
    elif kind == "tag":
        content = fmt.get("content")
        begin = fmt.get("begin") if isinstance(fmt.get("begin"), str) else None
        elements = content.get("elements") if isinstance(content, dict) and content.get("type") == "sequence" else None
        if (isinstance(elements, list) and len(elements) > 1 and isinstance(elements[0], dict)
                and elements[0].get("type") == "json_schema" and isinstance(elements[1], dict)
                and elements[1].get("type") == "const_string"):  # begin, a part, its end, more
            found.append((elements[0], "json_schema", begin, _ends(elements[1].get("value"))))
            _walk(elements[1:], found)
            return
        _walk(content, found, begin if isinstance(content, dict) else None, _ends(fmt.get("end")))
    else:
        for key in ("elements", "tags", "content"):
            if key in fmt:
                _walk(fmt[key], found)


def _holders(tag: dict) -> list[tuple[dict, str, Optional[str], tuple[str, ...]]]:
    """(dict holding the schema, its key, begin, ends) for each part of the tag."""
    found: list = []
    if "format" in tag:
        _walk(tag.get("format"), found)
    else:  # SGLang's legacy style: {"structures": [{"begin", "schema", "end"}], "triggers"}
        for s in tag.get("structures") or []:
            if isinstance(s, dict) and "schema" in s:
                found.append((s, "schema", s.get("begin") if isinstance(s.get("begin"), str) else None,
                              _ends(s.get("end"))))
    return found


def tag_parts(tag: dict) -> list[TagPart]:
    parts = []
    for i, (holder, key, begin, ends) in enumerate(_holders(tag)):
        schema, strict, name = _clean(holder.get(key) if key == "schema" else holder.get("json_schema"))
        ws = holder.get("max_whitespace_cnt") if key == "json_schema" else None
        style = holder.get("style", "json") if key == "json_schema" else "json"
        parts.append(TagPart(i, name or f"tag {i}", begin, ends, schema, strict,
                             ws if isinstance(ws, int) and not isinstance(ws, bool) else None,
                             style if style in ARG_STYLES else "json"))
    return parts


def map_parts(tag: dict, fn: Callable[[TagPart], Any]) -> dict:
    """A copy of ``tag`` with each part's schema replaced by ``fn(part)`` (the library copy:
    our keywords gone, the backend's options applied)."""
    copy = json.loads(json.dumps(tag))
    for part, (holder, key, _, _) in zip(tag_parts(tag), _holders(copy)):
        holder["schema" if key == "schema" else "json_schema"] = fn(part)
        if part.style == "pythonic":  # no library has this style: our grammar of it
            holder.clear()
            holder.update({"type": "grammar", "grammar": kwargs_grammar(part.schema)})
    return copy


def find_documents(text: str, parts: list[TagPart]) -> Iterator[tuple[TagPart, str]]:
    """Each completed part in ``text``: its begin, a whole JSON value, then one of its ends.
    Scans left to right; a value cut short (max_tokens) is not a document."""
    located = [p for p in parts if p.begin]
    pos = 0
    while located:
        hits = [(text.find(p.begin, pos), -len(p.begin), p) for p in located]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            return
        at, neg_len, part = min(hits, key=lambda h: (h[0], h[1]))
        start = _WS.match(text, at - neg_len).end() if part.style == "json" else at - neg_len
        found = decode_document(part.style, text, start, part.name, part.schema, part.ends)
        if found is None:
            pos = at + 1
            continue
        document, stop = found
        end_at = stop if any(text.startswith(e, stop) for e in part.ends) else _WS.match(text, stop).end()
        if not part.ends or any(text.startswith(e, end_at) for e in part.ends):
            yield part, document
        pos = stop
