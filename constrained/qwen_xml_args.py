"""Arguments codec for the Qwen3-Coder / Qwen3.5 XML tool-call format (``qwen3_coder``).

A call is ``<tool_call>\\n<function=NAME>\\n`` + parameters + ``</function>\\n</tool_call>``,
each parameter ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``. Strings are written raw (no
quotes, no escapes), so the value's type comes from the tool's schema, not from the text.

Template vs xgrammar (``JSONSchemaFormat(style="qwen_xml")``, 0.2.9):
- the template writes top-level booleans / null with Jinja's ``|string``: ``True``, ``False``,
  ``None``; the grammar only accepts ``true`` / ``false`` / ``null`` for boolean- / null-typed
  parameters. ``render_parameters(..., json_literals=True)`` writes the grammar's spelling;
  ``parse_parameters`` reads both.
- the grammar allows any whitespace around non-string values and between parameters, but none
  around a string-typed value: the template's ``\\n`` padding is part of the raw string there,
  so the parser strips one leading and one trailing newline, as the template added them.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
# The template's ``|string`` spelling of Python scalars, read back as JSON's.
_PY_LITERALS = {"True": True, "False": False, "None": None}
_OPEN = re.compile(r"\s*<parameter=([^>\n]+)>")
_CLOSE = "</parameter>"


def render_parameters(arguments: dict, *, json_literals: bool = False) -> str:
    """The parameter block exactly as Qwen3-Coder's chat template writes it for ``arguments``
    (a decoded JSON object); it ends with ``\\n``, before ``</function>``.

    Mappings and lists go through the template's ``tojson`` (``json.dumps`` with
    ``ensure_ascii=False``), strings raw, other scalars through ``|string`` (``str()``).
    ``json_literals=True`` writes booleans / null as JSON instead, which is what xgrammar's
    ``qwen_xml`` grammar accepts for boolean- / null-typed parameters. A string containing
    ``</parameter>`` is written as the template would, but cannot be read back."""
    if not isinstance(arguments, dict):
        raise ValueError(f"tool-call arguments must be an object, got {type(arguments).__name__}")
    parts = []
    for key, value in arguments.items():
        parts.append(f"<parameter={key}>\n{_render_value(value, json_literals)}\n</parameter>\n")
    return "".join(parts)


def _render_value(value: Any, json_literals: bool) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False)
    if json_literals and (value is None or isinstance(value, bool)):
        return json.dumps(value)
    return str(value)


def parse_parameters(text: str, schema: Optional[dict]) -> dict:
    """Rebuild the arguments object from a parameter block (the text between
    ``<function=NAME>\\n`` and ``</function>``), typing each value by ``schema``'s property.

    string: the raw text (one template newline stripped each side); integer / number /
    boolean / null / array / object: JSON (``True``/``False``/``None`` also read, as the
    template writes them); a union, ``anyOf``/``oneOf``, enum/const or untyped property: JSON if
    it parses as an allowed type, else the raw string when strings are allowed. A key not in
    ``properties`` is typed by ``additionalProperties`` when that is a schema, else untyped.
    Raises ValueError on malformed text, a repeated key, or a value not of its type."""
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    out: dict = {}
    pos = 0
    while True:
        m = _OPEN.match(text, pos)
        if m is None:
            if text[pos:].strip():
                raise ValueError(f"expected '<parameter=NAME>' at offset {pos}: {text[pos:pos + 40]!r}")
            return out
        key = m.group(1)
        end = text.find(_CLOSE, m.end())
        if end < 0:
            raise ValueError(f"parameter {key!r} is not closed by {_CLOSE!r}")
        if key in out:
            raise ValueError(f"parameter {key!r} appears twice")
        sub = props.get(key, extra if isinstance(extra, dict) else {})
        sub = sub if isinstance(sub, dict) else {}
        out[key] = _parse_value(key, text[m.end():end], sub)
        pos = end + len(_CLOSE)


def _allowed_types(schema: Any) -> Optional[frozenset]:
    """The JSON types a property schema allows; None when any (untyped, $ref, true)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return frozenset({_type_of(schema["const"])})
    if isinstance(schema.get("enum"), list):
        return frozenset(_type_of(v) for v in schema["enum"])
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset({t}) if t in _TYPES else None
    if isinstance(t, list):
        return frozenset(t) if t and all(x in _TYPES for x in t) else None
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        subs = [_allowed_types(b) for b in branches]
        return None if any(s is None for s in subs) else frozenset().union(*subs)
    return None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _fits(value: Any, allowed: Optional[frozenset]) -> bool:
    if allowed is None:
        return True
    t = _type_of(value)
    return t in allowed or (t == "integer" and "number" in allowed)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # json.loads would accept NaN / Infinity


def _parse_value(key: str, raw: str, schema: Any) -> Any:
    allowed = _allowed_types(schema)
    as_string = raw[1:] if raw.startswith("\n") else raw
    as_string = as_string[:-1] if as_string.endswith("\n") else as_string
    stripped = raw.strip()
    # The grammar allows whitespace around an enum / const member, unlike a free string.
    members = [schema["const"]] if "const" in schema else schema.get("enum")
    members = members if isinstance(members, list) else []
    if as_string not in members and stripped in members:
        return stripped
    if allowed == frozenset({"string"}):
        return as_string
    try:
        value = json.loads(stripped, parse_constant=_reject_constant)
        found = True
    except ValueError:
        value, found = _PY_LITERALS.get(stripped), stripped in _PY_LITERALS
    if found and _fits(value, allowed):
        if isinstance(value, float) and not math.isfinite(value):  # e.g. 1e999
            raise ValueError(f"parameter {key!r}: {stripped!r} is out of range")
        return value
    if allowed is None or "string" in allowed:
        return as_string
    want = " or ".join(sorted(allowed))
    raise ValueError(f"parameter {key!r}: expected {want}, got {stripped[:60]!r}")
