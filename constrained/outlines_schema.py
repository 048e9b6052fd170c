"""JSON schema -> a regex outlines-core matches exactly, or a ValueError naming why not.

outlines-core's converter (``build_regex_from_schema``, 0.2.14) picks one branch per schema
node and silently ignores the keywords outside it (minimum/maximum, pattern next to a
length, allOf next to properties, oneOf taken as anyOf, uniqueItems, ...), so its output
could break the schema: ``adapt_schema`` refuses such schemas instead, naming the keyword.
It rewrites two things exactly: a small integer range becomes an enum, and ``{}`` an
explicit anyOf (converted as is, ``{}`` gives an ungrouped alternation: a wrong regex).
Objects with properties come out closed, keys in declared order: narrower, still valid.
A string ``pattern`` is pasted raw between the JSON quotes, so ``json_text_pattern`` first
turns it into a regex over the JSON text; of the formats, only those whose regex is
JSON-safe and right are kept (outlines' email/uri can emit a raw quote, its time a backslash).
"""
from __future__ import annotations

import json
import math

import outlines_core as oc

from constrained.grammar_config import JsonOptions
from constrained.json_number_bounds import EXPONENT_DIGITS, FRACTION_DIGITS, NUMBER_INT_DIGITS

_WHITESPACE = r"[\x20\x0A\x0D\x09]"
_ANY_JSON = {"anyOf": [{"type": t} for t in ("null", "boolean", "number", "string", "array", "object")]}
_MAX_ENUM_RANGE = 10_000  # integer ranges up to this wide become an exact enum (~0.5 s)
# Number literals bounded as for the other backends (json_number_bounds.py), swapped into the
# regex outlines-core generates; integers keep 18 digits, inside the int64 range.
_BOUNDED_NUMBERS = (
    (oc.json_schema.NUMBER, rf"((-)?(0|[1-9][0-9]{{0,{NUMBER_INT_DIGITS - 1}}}))"
                            rf"(\.[0-9]{{1,{FRACTION_DIGITS}}})?([eE][+-][0-9]{{1,{EXPONENT_DIGITS}}})?"),
    (oc.json_schema.INTEGER, r"(-)?(0|[1-9][0-9]{0,17})"))
# Validation keywords: one present but not used by outlines-core's converter is refused.
_ASSERTIONS = set("""type enum const properties required additionalProperties patternProperties
    propertyNames minProperties maxProperties dependentRequired dependentSchemas dependencies
    unevaluatedProperties items prefixItems additionalItems unevaluatedItems minItems maxItems
    uniqueItems contains minContains maxContains minLength maxLength pattern format minimum maximum
    exclusiveMinimum exclusiveMaximum multipleOf allOf anyOf oneOf not if then else $ref
    $dynamicRef $recursiveRef""".split())
_BRANCHES = (  # outlines-core's dispatch order; objects with properties are closed (narrower)
    ("properties", {"properties", "required", "type", "additionalProperties", "unevaluatedProperties"}),
    ("allOf", {"allOf"}), ("anyOf", {"anyOf"}), ("oneOf", {"oneOf"}),
    ("prefixItems", {"prefixItems", "items", "type"}), ("enum", {"enum", "type"}),
    ("const", {"const", "type"}), ("$ref", {"$ref"}))
_SAFE = r'[^"\\\x00-\x1F]'  # a character a JSON string holds unescaped
_ANY_TEXT = rf'(?:{_SAFE}|\\["\\/bfnrt])*'  # any JSON string content
_ESCAPES = {"\\": r"\\\\", '"': r'\\"', "n": r"\\n", "t": r"\\t", "r": r"\\r", "f": r"\\f"}
_FORMATS = {"date", "date-time", "uuid"}
_NUMERIC = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}


def _honored(node: dict) -> set:
    """The keywords outlines-core's converter uses for ``node``: the first branch present wins."""
    for key, keys in _BRANCHES:
        if key in node:  # allOf concatenates regexes and oneOf becomes anyOf: exact for one only
            exact = key not in ("allOf", "oneOf") or (isinstance(node[key], list) and len(node[key]) == 1)
            return keys if exact else set()
    keys = {"type"}
    for t in node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]:
        if t == "string":  # lengths win over pattern, pattern over format
            keys |= ({"minLength", "maxLength"} if {"minLength", "maxLength"} & node.keys()
                     else {"pattern"} if "pattern" in node else {"format"})
        elif t == "array":
            keys |= {"items", "minItems", "maxItems"}
        elif t == "object":
            keys |= {"additionalProperties", "minProperties", "maxProperties"}
    return keys


def _integer_range_as_enum(node: dict) -> dict:
    """``{"type": "integer", "minimum": a, "maximum": b}`` with a small range -> an enum."""
    bounds = {k: node[k] for k in _NUMERIC & node.keys()}
    if node.get("type") != "integer" or not bounds or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in bounds.values()):
        return node
    lows = [math.ceil(v) if k == "minimum" else math.floor(v) + 1
            for k, v in bounds.items() if k in ("minimum", "exclusiveMinimum")]
    highs = [math.floor(v) if k == "maximum" else math.ceil(v) - 1
             for k, v in bounds.items() if k in ("maximum", "exclusiveMaximum")]
    lo, hi, step = max(lows, default=None), min(highs, default=None), bounds.get("multipleOf", 1)
    if lo is None or hi is None or hi - lo >= _MAX_ENUM_RANGE or not isinstance(step, int) or step <= 0:
        return node
    values = [v for v in range(lo, hi + 1) if v % step == 0]
    if not values:
        raise ValueError(f"no integer satisfies {json.dumps(bounds)}")
    return {**{k: v for k, v in node.items() if k not in _NUMERIC}, "enum": values}


def adapt_schema(node, path: str = "$"):
    """A copy of the schema outlines-core converts exactly; ValueError where it could not."""
    if node is True or node == {}:
        return _ANY_JSON
    if not isinstance(node, dict):
        raise ValueError(f"outlines-core cannot compile the schema {json.dumps(node)[:80]} at {path}")
    node = _integer_range_as_enum(node)
    for key in sorted((_ASSERTIONS & node.keys()) - _honored(node)):
        raise ValueError(f"outlines-core does not enforce {key!r} (at {path}), so the output could "
                         f"break the schema; use the xgrammar or llguidance backend")
    if "format" in _honored(node) and node.get("format", "date") not in _FORMATS:
        raise ValueError(f"the outlines backend supports only the formats {sorted(_FORMATS)} (at {path})")
    missing = set(node.get("required", ())) - set(node.get("properties", ()))
    if "properties" in node and missing:
        raise ValueError(f"outlines-core ignores required keys missing from properties: {sorted(missing)}")
    out = dict(node)
    if "pattern" in _honored(node) and isinstance(node.get("pattern"), str):
        out["pattern"] = json_text_pattern(node["pattern"])
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            out[key] = {k: adapt_schema(v, f"{path}.{key}.{k}") for k, v in node[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            out[key] = [adapt_schema(v, f"{path}.{key}[{i}]") for i, v in enumerate(node[key])]
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict) and key in _honored(node) and "properties" not in node:
            out[key] = adapt_schema(node[key], f"{path}.{key}")
    return out


def json_text_pattern(pattern: str) -> str:
    """``pattern`` (a search over the string's value) as a full match over its JSON text: ends
    without an anchor get any content; a quote or backslash is escaped as JSON writes it;
    ``.``, classes and \\s \\S \\W \\D keep to unescaped characters (narrower: never invalid)."""
    head, tail = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    body, out, i = pattern[head:len(pattern) - tail], [], 0
    while i < len(body):
        c, nxt = body[i], body[i + 1:i + 2]
        if c == "\\" and nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
        elif c == "\\" and nxt in ("s", "S", "W", "D"):
            out.append(rf"[\{nxt}&&{_SAFE}]")
        elif c == "\\" and nxt and nxt in "xuUvP0123456789":
            raise ValueError(f"the outlines backend cannot map \\{nxt} in pattern {pattern!r} to JSON text")
        elif c == "\\":
            out.append(body[i:i + 2])
        elif c == "[":
            end = _class_end(body, i)
            out.append(f"[{body[i:end]}&&{_SAFE}]")
            i = end
            continue
        else:
            out.append(_SAFE if c == "." else _ESCAPES['"'] if c == '"' else c)
        i += 1 + (c == "\\")
    return f"^{'' if head else _ANY_TEXT}(?:{''.join(out)}){'' if tail else _ANY_TEXT}$"


def _class_end(p: str, i: int) -> int:
    """The index after the character class that opens at ``p[i]`` (nested classes included)."""
    j = i + 1 + (p[i + 1:i + 2] == "^")
    j += p[j:j + 1] == "]"  # a leading ] is a literal
    while j < len(p):
        if p[j] == "\\":
            j += 2
        elif p.startswith("[:", j):
            j = p.index(":]", j) + 2
        elif p[j] == "[":
            j = _class_end(p, j)
        elif p[j] == "]":
            return j + 1
        else:
            j += 1
    raise ValueError(f"unterminated character class in pattern {p!r}")


def whitespace_pattern(opts: JsonOptions) -> str:
    """The same whitespace language the other backends use between JSON tokens."""
    if opts.disable_any_whitespace:
        return ""
    if opts.whitespace_pattern is not None:
        return f"(?:{opts.whitespace_pattern})"
    return f"{_WHITESPACE}{{0,{opts.max_whitespace}}}" if opts.max_whitespace else f"{_WHITESPACE}*"


def schema_to_regex(spec: str, opts: JsonOptions) -> str:
    regex = oc.json_schema.build_regex_from_schema(json.dumps(adapt_schema(json.loads(spec))),
                                                   whitespace_pattern(opts))
    for unbounded, bounded in () if opts.unbounded_numbers else _BOUNDED_NUMBERS:
        regex = regex.replace(unbounded, bounded)
    return regex
