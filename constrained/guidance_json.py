"""llguidance's reading of a JSON schema, decided without a tokenizer.

The grammar text llguidance would compile for a schema (with this server's JSON options) and
whether llguidance enforces all of it are both found by ``LLMatcher.validate_grammar``, which
needs no tokenizer and takes about a millisecond. So the HTTP frontend can answer ``strict``
before a response starts (strict_check.py), and the llguidance backend compiles exactly the
text checked here.
"""
from __future__ import annotations

import json
import re
from typing import Any

import llguidance as llg

from constrained.grammar_config import JsonOptions, split_json_layout
from constrained.grammar_errors import clean_error
from constrained.json_number_bounds import LLGUIDANCE_BOUNDS, bound_numbers
from constrained.json_one_of import exclusive_one_of
from constrained.schema_coverage import STANDARD_FORMATS, Gap, keyword_gaps, schema_nodes

WHITESPACE = r"[\x20\x0A\x0D\x09]"
_DRAFTS = re.compile(r"^https?://json-schema\.org/(draft-0[3467]/schema|draft/20(19-09|20-12)/schema)#?$")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def close_objects(schema):
    """Objects with ``properties`` but no ``additionalProperties`` get ``false``, as
    xgrammar's strict mode (and OpenAI's strict schemas) do, so both backends -- and auto's
    fallback -- generate the same shape instead of inventing extra keys. Not inside allOf,
    nor in a schema an allOf branch refers to: closing each branch would make the
    conjunction unsatisfiable."""
    shared: set[str] = set()
    _all_of_refs(schema, False, shared)
    return _close(schema, "#", False, shared)


def _all_of_refs(node, in_all_of: bool, found: set[str]) -> None:
    pairs = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ()
    for key, value in pairs:
        if in_all_of and key == "$ref" and isinstance(value, str):
            found.add(value)
        elif key not in ("enum", "const", "default", "examples"):
            _all_of_refs(value, in_all_of or key == "allOf", found)


def _close(node, path: str, in_all_of: bool, shared: set[str]):
    if isinstance(node, list):
        return [_close(n, f"{path}/{i}", in_all_of, shared) for i, n in enumerate(node)]
    if not isinstance(node, dict):
        return node
    in_all_of = in_all_of or path in shared
    out = {}
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):  # data, not schema
            out[key] = value
        else:
            sub = f"{path}/{key.replace('~', '~0').replace('/', '~1')}"
            out[key] = _close(value, sub, in_all_of or key == "allOf", shared)
    if ("properties" in out and not in_all_of and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def without_unknown_draft(schema):
    """The schema without a ``$schema`` that names no JSON Schema draft (Snowplow's
    ``iglu:`` URIs): llguidance would try to resolve it, and fail; validators read 2020-12."""
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str) and not _DRAFTS.match(schema["$schema"]):
        return {k: v for k, v in schema.items() if k != "$schema"}
    return schema


def json_overrides(opts: JsonOptions) -> dict:
    """llguidance's ``x-guidance`` options for the server's (or a request's) JSON layout."""
    if opts.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if opts.whitespace_pattern is not None:
        return {"whitespace_pattern": opts.whitespace_pattern}
    if opts.max_whitespace:
        return {"whitespace_pattern": f"{WHITESPACE}{{0,{opts.max_whitespace}}}"}
    return {"whitespace_flexible": True}


def validate(grammar: str) -> list[str]:
    """llguidance's warnings for ``grammar``; ValueError with its error when it refuses it."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError("; ".join(messages) or "llguidance refused the grammar")
    return list(messages)


def json_grammar(spec: str, opts: JsonOptions, lenient: bool) -> tuple[str, list[str], Any]:
    """(grammar text, warnings, the schema compiled) of a json_schema spec. Default mode
    refuses (ValueError) every keyword llguidance does not enforce, so what passes is exact;
    lenient drops them (named in the warnings) and reads oneOf as anyOf, after narrowing
    what json_one_of can make exact."""
    spec, opts = split_json_layout(spec, opts)
    defaults = {"lenient": True, "coerce_one_of": True} if lenient else None
    schema = close_objects(without_unknown_draft(json.loads(spec)))
    if not opts.unbounded_numbers:
        schema = bound_numbers(schema, LLGUIDANCE_BOUNDS)
    if lenient and "oneOf" in spec:
        schema = exclusive_one_of(schema) or schema
    overrides = json_overrides(opts)
    grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults, overrides=overrides)
    try:
        warnings = validate(grammar)
    except ValueError as e:  # oneOf it cannot prove disjoint: narrow closed-object branches
        exclusive = exclusive_one_of(schema) if "oneOf" in str(e) else None
        if exclusive is None:
            raise
        grammar = llg.LLMatcher.grammar_from_json_schema(exclusive, defaults=defaults, overrides=overrides)
        return grammar, [], exclusive
    return grammar, warnings if lenient else [], schema


def lenient_gaps(schema, warnings: list[str]) -> list:
    """Where the keywords llguidance's lenient mode says it dropped are (schema_coverage)."""
    keywords, formats = set(), set()
    for w in warnings:
        for found in _UNIMPLEMENTED.findall(w):
            keywords.update(json.loads(found))
        formats.update(_UNKNOWN_FORMAT.findall(w))
        if "oneOf" in w:
            keywords.add("oneOf")
    gaps = keyword_gaps(schema, keywords)
    if formats & STANDARD_FORMATS:  # others are annotations: no validator asserts them
        gaps += [Gap("format", path) for node, path in schema_nodes(schema)
                 if node.get("format") in formats & STANDARD_FORMATS]
    return gaps


def guidance_gaps(spec: str, opts: JsonOptions) -> tuple[list, bool]:
    """(what llguidance would drop from the schema, whether lenient mode is needed):
    ([], False) when it is exact. ValueError when it refuses the schema in both modes."""
    try:
        json_grammar(spec, opts, lenient=False)
        return [], False
    except ValueError as e:
        refused = clean_error(e)
    try:
        _, warnings, compiled = json_grammar(spec, opts, lenient=True)
    except ValueError as e:
        raise ValueError(f"{refused}; in lenient mode: {clean_error(e)}") from None
    gaps = lenient_gaps(compiled, warnings)  # paths: the compiled schema keeps the user's
    if not gaps and not warnings:  # refused for a reason lenient mode does not name
        gaps = [f"(llguidance: {refused})"]
    return gaps, True


def tag_schema(schema: Any, opts: JsonOptions, max_whitespace, lenient: bool) -> Any:
    """A structural tag's JSON schema as llguidance's ``%json`` embeds it, with the JSON
    options dispatch applies to json_schema (the tag's own whitespace bound wins)."""
    if not isinstance(schema, dict):
        return schema
    schema = close_objects(without_unknown_draft(schema))
    if not opts.unbounded_numbers:
        schema = bound_numbers(schema, LLGUIDANCE_BOUNDS)
    if lenient and "oneOf" in json.dumps(schema):
        schema = exclusive_one_of(schema) or schema
    extra = dict(json_overrides(opts))
    if max_whitespace and extra.get("whitespace_flexible") is not False:
        extra = {"whitespace_pattern": f"{WHITESPACE}{{0,{max_whitespace}}}"}
    if lenient:
        extra.update(lenient=True, coerce_one_of=True)
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **extra}}
