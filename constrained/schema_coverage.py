"""Which keywords of a JSON schema a grammar enforces: the basis of ``strict`` and of
validating approximate grammars (docs/constrained.md "Structured outputs").

A grammar is *exact* when every document it admits is valid against the schema; narrowing
is fine (closed objects, bounded numbers, anchored patterns), widening is not. Each keyword
that a grammar drops, and that could therefore let an invalid document through, is a
``Gap``: the keyword and the JSON pointer of the schema node holding it.

* llguidance reports for itself: in its default (strict) mode it refuses every keyword it
  does not enforce, so a schema it compiles is exact; in lenient mode its warnings name the
  keys it dropped, and ``keyword_gaps`` finds where they are.
* xgrammar (0.2.x) does not say what it drops, so ``xgrammar_gaps`` is a conservative
  whitelist measured against it (tests/test_schema_coverage.py keeps it honest): a node is
  read as ONE of $ref / const / enum / anyOf / oneOf / allOf / its ``type``, and the other
  assertions of that node are ignored; some keywords are never enforced; lengths next to a
  pattern or format, multipleOf, and assertions on a node without ``type`` are dropped.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from constrained.schema_validation import ASSERTED_FORMATS

# Root keyword marking a json_schema spec as OpenAI-strict (part of the grammar cache key).
STRICT_KEY = "x-gramsync-strict"

# Keywords that constrain a document; anything else (title, examples, x-*, ...) does not.
ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "contains", "maxProperties", "minProperties",
    "required", "dependentRequired", "dependentSchemas", "dependencies", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
    "additionalItems", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
    "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef"})
_SUBSCHEMA = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems", "items")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "dependencies", "$defs",
                   "definitions")
# Only the formats our validator asserts can be broken (others are annotations): a backend
# dropping one of these has a gap. xgrammar enforces the syntax of all of them.
STANDARD_FORMATS = ASSERTED_FORMATS
_XGRAMMAR_FORMATS = frozenset({  # it keeps these, and drops a pattern next to them
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_SEMANTIC_FORMAT = re.compile(r'"format":\s*"(date|date-time|time|hostname|ipv4|ipv6)"')
_XGRAMMAR_NEVER = ("not", "if", "dependentRequired", "dependentSchemas", "dependencies",
                   "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
_XGRAMMAR_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "object": {"properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "unevaluatedProperties", "propertyNames"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "additionalItems",
              "uniqueItems"},
    "boolean": set(), "null": set(),
}
_COMPOUND = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_JSON_TYPES = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}


@dataclass(frozen=True)
class Gap:
    keyword: str
    path: str  # JSON pointer of the schema node holding the keyword, "#" for the root

    def __str__(self) -> str:
        return f"{self.keyword} at {self.path}"


@dataclass(frozen=True)
class GrammarReport:
    """What served a request's constraint (rank -> frontend, with its final output):
    ``meta_info["grammar"]``, and whether the document needs validating."""

    backend: str  # "xgrammar", "llguidance", ...
    exact: bool
    approximated: tuple[str, ...] = ()  # the gaps, as "keyword at #/path"

    def to_json(self) -> dict:
        return {"backend": self.backend, "exact": self.exact, "approximated": list(self.approximated)}


def split_strict(spec: str) -> tuple[str, bool]:
    """(the json_schema spec without STRICT_KEY, whether it was there and true)."""
    if STRICT_KEY not in spec:
        return spec, False
    schema = json.loads(spec)
    if not isinstance(schema, dict) or STRICT_KEY not in schema:
        return spec, False
    strict = schema.pop(STRICT_KEY) is True
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False), strict


def with_strict(schema: Any, strict: bool) -> Any:
    """``schema`` (parsed) marked strict when ``strict``."""
    if not strict:
        return schema
    if isinstance(schema, bool):  # the same languages as true / false, as objects
        schema = {} if schema else {"not": {}}
    return {**schema, STRICT_KEY: True}


def _pointer(path: str, key: Any) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


def resolve(root: Any, ref: Any) -> Optional[tuple[Any, str]]:
    """(target, its pointer) of a local ``#/...`` reference, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node, path = root, "#"
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
        path = _pointer(path, part)
    return node, path


def schema_nodes(root: Any) -> Iterator[tuple[dict, str]]:
    """Every object schema reachable from the root (local references followed once), with
    its JSON pointer. Property names and data (enum, const, examples) are never mistaken
    for keywords."""
    seen: set[str] = set()
    stack = [(root, "#")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict) or path in seen:
            continue
        seen.add(path)
        yield node, path
        found = resolve(root, node.get("$ref"))
        if found is not None:
            stack.append(found)
        for key in _SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], _pointer(path, key)))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, _pointer(_pointer(path, key), i)) for i, sub in enumerate(node[key]))
        for key in _SUBSCHEMA_MAPS[:4]:  # $defs / definitions: only where referred to
            if isinstance(node.get(key), dict):
                stack.extend((sub, _pointer(_pointer(path, key), name)) for name, sub in node[key].items())


def keyword_gaps(schema: Any, keywords: set[str]) -> list[Gap]:
    """Where each of ``keywords`` occurs (llguidance names what it dropped, not where)."""
    gaps = [Gap(k, path) for node, path in schema_nodes(schema) for k in node
            if k in keywords and not (k == "oneOf" and exclusive_branches(schema, node["oneOf"]))]
    return sorted(gaps, key=lambda g: (g.path, g.keyword))


def exclusive_branches(root: Any, branches: Any) -> bool:
    """Can a document match at most one branch, by construction? True when the branches
    have distinct single JSON types (integer and number overlap), or when all are objects
    that require one property and fix it to pairwise disjoint ``const``/``enum`` values
    (pydantic's discriminated unions). Then ``oneOf`` is exactly ``anyOf``."""
    if not isinstance(branches, list) or not branches:
        return False
    nodes = []
    for b in branches:
        found = resolve(root, b["$ref"]) if isinstance(b, dict) and set(b) & ASSERTIONS == {"$ref"} else (b, "")
        if found is None or not isinstance(found[0], dict):
            return False
        nodes.append(found[0])
    types = [n.get("type") for n in nodes]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) and {"integer", "number"} - set(types):
        return True
    for name in nodes[0].get("required", []) if isinstance(nodes[0].get("required"), list) else []:
        values = [_fixed_values(n, name) for n in nodes]
        if all(v is not None for v in values):
            flat = [json.dumps(x, sort_keys=True) for v in values for x in v]
            if len(flat) == len(set(flat)):
                return True
    return False


def _fixed_values(node: dict, name: str) -> Optional[list]:
    props = node.get("properties")
    if not (isinstance(props, dict) and isinstance(node.get("required"), list) and name in node["required"]
            and isinstance(props.get(name), dict)):
        return None
    prop = props[name]
    if "const" in prop:
        return [prop["const"]]
    return list(prop["enum"]) if isinstance(prop.get("enum"), list) else None


def xgrammar_gaps(schema: Any) -> list[Gap]:
    """The keywords xgrammar would not enforce (conservative: when unsure, a gap)."""
    gaps: list[Gap] = []
    for node, path in schema_nodes(schema):
        if path.endswith("/propertyNames") and "type" not in node:
            node = {**node, "type": "string"}  # property names are strings: xgrammar knows it
        gaps.extend(Gap(k, path) for k in _xgrammar_node_gaps(schema, node))
    return sorted(set(gaps), key=lambda g: (g.path, g.keyword))


def _xgrammar_node_gaps(root: Any, node: dict) -> list[str]:
    present = [k for k in node if k in ASSERTIONS]
    gaps = [k for k in present if k in _XGRAMMAR_NEVER]
    if node.get("uniqueItems") is True:
        gaps.append("uniqueItems")
    present = [k for k in present if k not in _XGRAMMAR_NEVER and k not in ("then", "else", "uniqueItems")]
    compound = next((k for k in _COMPOUND if k in node), None)
    if compound is not None:
        if compound == "oneOf" and not exclusive_branches(root, node["oneOf"]):
            gaps.append("oneOf")
        if compound == "allOf" and (not isinstance(node["allOf"], list) or len(node["allOf"]) > 1):
            gaps.append("allOf")
        for k in present:
            if k != compound and not (k == "type" and compound in ("const", "enum")
                                      and _values_typed(node, node["type"])):
                gaps.append(k)
        return gaps
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(t in _XGRAMMAR_BY_TYPE for t in types):
        return gaps + [k for k in present if k != "type"]  # untyped: its assertions are ignored
    allowed = set().union(*(_XGRAMMAR_BY_TYPE[t] for t in types))
    applicable = set().union(*_XGRAMMAR_BY_TYPE.values())
    for k in present:
        if k == "type" or k not in applicable or k not in allowed:
            continue  # a keyword for another type asserts nothing here
        if k in ("minLength", "maxLength") and ("pattern" in node or "format" in node):
            gaps.append(k)
        elif k == "pattern" and node.get("format") in _XGRAMMAR_FORMATS:
            gaps.append(k)  # it keeps a format it knows and drops the pattern
        elif k == "propertyNames" and ("properties" in node or "patternProperties" in node):
            gaps.append(k)
        elif k == "required" and not set(_names(node["required"])) <= set(_names(node.get("properties"))):
            gaps.append(k)  # enforced only for names declared in properties
        elif k == "patternProperties" and _shadows_a_property(node):
            gaps.append(k)  # a declared property is checked against properties alone
    if "multipleOf" in node and {"integer", "number"} & set(types):
        gaps.append("multipleOf")
    return gaps


def _names(value: Any) -> list:
    return list(value) if isinstance(value, (list, dict)) else []


def _shadows_a_property(node: dict) -> bool:
    """Does a patternProperties pattern (or one we cannot read) match a declared name?"""
    patterns = node["patternProperties"] if isinstance(node["patternProperties"], dict) else {}
    for pattern in patterns:
        try:
            if any(re.search(pattern, name) for name in _names(node.get("properties"))):
                return True
        except re.error:
            return True
    return False


def needs_format_check(schema_text: str) -> bool:
    """Does the schema use a format whose grammars check only the syntax (both libraries
    admit 2024-02-30, a leap second at any offset, a 64-octet hostname label, 01.1.1.1)?
    Such documents are validated even when the grammar is otherwise exact."""
    return _SEMANTIC_FORMAT.search(schema_text) is not None


def _values_typed(node: dict, types: Any) -> bool:
    """Do all of a node's enum/const values have one of ``types`` (so ``type`` adds nothing)?"""
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else []
    return all(any(_has_type(v, t) for t in types) for v in values)


def _has_type(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or (isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return t in _JSON_TYPES and isinstance(value, _JSON_TYPES[t])


class StrictSchemaError(ValueError):
    """A strict schema (the 400) that ``who`` cannot serve exactly; ``gaps`` say why."""

    def __init__(self, gaps: list, who: str) -> None:
        self.gaps = list(gaps)
        listed = ", ".join(str(g) for g in self.gaps[:20]) + (
            f" (and {len(self.gaps) - 20} more)" if len(self.gaps) > 20 else "")
        super().__init__(
            f"strict: true needs a grammar that enforces every keyword of the schema, but {who}: "
            f"{listed or 'it cannot tell'}. Without strict the server serves the "
            "closest approximation and validates each finished document against the full schema.")
