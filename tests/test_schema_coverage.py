"""constrained/schema_coverage.py kept honest against the real libraries (no mocks).

* xgrammar (0.2.x) does not say what it drops, so ``xgrammar_gaps`` is a measured whitelist.
  Each case here is (schema, a document the schema rejects, one it accepts, the gaps the
  analyzer must claim), checked the way the probes that produced the rules were: the grammar
  built as the server builds it (compact separators), string acceptance with xgrammar's own
  test helper, and the documents with python-jsonschema and the server's validator
  (jsonschema-rs). A claimed gap must be real (xgrammar admits the invalid document, and
  the validator blames a gap keyword); a claimed exact schema must reject it.
  ``CONSERVATIVE`` lists gaps xgrammar actually enforces (harmless, but such schemas go to
  llguidance for nothing); ``xfail(strict=True)`` cases are known analyzer bugs, written
  with the gaps the analyzer SHOULD claim, so a fix turns them into XPASS (then drop the mark).
* llguidance reports for itself (strict mode refuses, lenient mode names what it dropped):
  ``GuidanceBackend.compile_json_schema`` must turn that into "keyword at #/path".
* strict markers, and ``--grammar-backend auto``'s choice between the two.
"""
from __future__ import annotations

import json
from typing import Literal, Union

import pytest
import xgrammar as xgr
from jsonschema import Draft202012Validator, validators
from xgrammar.testing import _is_grammar_accept_string

from constrained.auto_backend import AutoGrammarBackend
from constrained.base_grammar_backend import InvalidGrammarObject
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend, lenient_gaps
from constrained.schema_coverage import (
    STRICT_KEY, Gap, StrictSchemaError, exclusive_branches, keyword_gaps, needs_format_check, split_strict,
    with_strict, xgrammar_gaps,
)
from constrained.schema_validation import ASSERTED_FORMATS, SchemaValidators

VOCAB, EOS = 49152, (2,)
SNOWPLOW = "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#"
_SERVER_VALIDATOR = SchemaValidators()


# ---- helpers --------------------------------------------------------------------------------
def xgrammar_accepts(schema, document: str) -> bool:
    """As the server builds it (json_schema with disable_any_whitespace: compact separators)."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    return _is_grammar_accept_string(grammar, document)


def violation(schema, document: str):
    """The server validator's verdict (None: valid), cross-checked with python-jsonschema
    (the schema's ``$schema`` draft, else 2020-12). python-jsonschema checks few formats without
    optional packages (no date-time, time, hostname, uri; email only for an "@"), so where a
    schema has a format the server's validator decides alone."""
    cls = validators.validator_for(schema, default=Draft202012Validator)
    python_ok = cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(json.loads(document))
    found = _SERVER_VALIDATOR.validate(json.dumps(schema), document)
    if '"format"' not in json.dumps(schema):
        assert python_ok == (found is None), (schema, document, found)
    return found


def blamed_on_a_gap(found, gaps: list[str]) -> bool:
    """Does the validator's schema path run through one of the dropped keywords?"""
    pointers = [f"{path}/{keyword}" for keyword, path in (g.split(" at ") for g in gaps)]
    return any(found.schema_path == p or found.schema_path.startswith(p + "/") for p in pointers)


def gap_strings(schema) -> list[str]:
    return [str(g) for g in xgrammar_gaps(schema)]


def pydantic_union_schema() -> dict:
    """A pydantic v2 discriminated union as the OpenAI SDK sends it (strict)."""
    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        breed: str

    class Pet(BaseModel):
        pet: Union[Cat, Dog] = Field(discriminator="kind")
        tags: list[str]

    return to_strict_json_schema(Pet)


PET = pydantic_union_schema()
assert PET["properties"]["pet"]["oneOf"] == [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]

OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


def _obj(**extra) -> dict:
    return {**OBJ_AB, **extra}


def _fmt(name: str, **extra) -> dict:
    return {"type": "string", "format": name, **extra}


def _known_bug(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"schema_coverage bug: {reason}")


# ---- 1. xgrammar: every claimed gap is real, every claimed exact is exact -------------------
# (id, schema, invalid document, valid document, the gaps xgrammar_gaps must report)
CASES = [
    # gaps: xgrammar admits the invalid document
    ("uniqueItems", {"type": "object", "required": ["tags"], "properties": {"tags": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     '{"tags":["a","a"]}', '{"tags":["a","b"]}', ["uniqueItems at #/properties/tags"]),
    ("not", {"type": "integer", "not": {"const": 3}}, "3", "4", ["not at #"]),
    ("if-then", _obj(**{"if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
                        "then": {"required": ["b"]}}),
     '{"a":1}', '{"a":1,"b":2}',
     ["if at #", "properties at #/if", "required at #/if", "required at #/then"]),
    ("dependentRequired", _obj(dependentRequired={"a": ["b"]}), '{"a":1}', '{"a":1,"b":2}',
     ["dependentRequired at #"]),
    # 2020-12 has no "dependencies": under draft-07 (which jsonschema-rs honours) it asserts.
    ("dependencies-draft7", _obj(**{"$schema": "http://json-schema.org/draft-07/schema#",
                                    "dependencies": {"a": ["b"]}}),
     '{"a":1}', '{"a":1,"b":2}', ["dependencies at #"]),
    ("dependentSchemas", _obj(dependentSchemas={"a": {"required": ["b"]}}), '{"a":1}', '{"a":1,"b":2}',
     ["dependentSchemas at #", "required at #/dependentSchemas/a"]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", "[5]",
     ["contains at #"]),
    ("oneOf-overlapping", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "1.5",
     ["oneOf at #"]),
    ("allOf-two", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1", "3",
     ["allOf at #", "minimum at #/allOf/1"]),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, "0.3", "1.5", ["multipleOf at #"]),
    # integers: enforced unbounded or in a small range (CONSERVATIVE), dropped in a half-open one
    ("multipleOf-integer-half-open", {"type": "integer", "minimum": 5, "multipleOf": 3}, "7", "9",
     ["multipleOf at #"]),
    ("minLength-next-to-pattern", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
     '"ab"', '"abc"', ["minLength at #"]),
    ("maxLength-next-to-pattern", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
     '"abcd"', '"abc"', ["maxLength at #"]),
    ("maxLength-next-to-format", _fmt("email", maxLength=8), '"abc@def.com"', '"a@b.com"',
     ["maxLength at #"]),
    ("ref-with-minimum", {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {
        "a": {"$ref": "#/$defs/n", "minimum": 3}}}, '{"a":1}', '{"a":3}', ["minimum at #/properties/a"]),
    ("enum-type-some-values-mismatch", {"type": "string", "enum": ["a", 1]}, "1", '"a"', ["type at #"]),
    ("enum-with-minLength", {"type": "string", "enum": ["a", "bbb"], "minLength": 2}, '"a"', '"bbb"',
     ["minLength at #"]),
    ("anyOf-with-sibling-minimum", {"anyOf": [{"type": "string"}, {"type": "integer"}], "minimum": 3},
     "1", "3", ["minimum at #"]),
    ("untyped-minimum", {"minimum": 3}, "1", "3", ["minimum at #"]),
    ("untyped-required", {"required": ["a"]}, "{}", '{"a":1}', ["required at #"]),
    ("untyped-minLength", {"minLength": 2}, '"a"', '"ab"', ["minLength at #"]),
    ("propertyNames-with-properties", {"type": "object", "properties": {"abc": {"type": "integer"}},
                                       "propertyNames": {"maxLength": 1},
                                       "additionalProperties": {"type": "integer"}},
     '{"abc":1}', '{"b":1}', ["propertyNames at #"]),

    # exact: xgrammar rejects the invalid document
    ("oneOf-const-discriminator-via-ref", {
        "$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
                        "required": ["k", "x"]},
                  "B": {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}},
                        "required": ["k", "y"]}},
        "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
     '{"k":"a","y":"s"}', '{"k":"a","x":1}', []),
    ("oneOf-pydantic-discriminated-union", PET, '{"pet":{"kind":"cat","breed":"x"},"tags":[]}',
     '{"pet":{"kind":"dog","breed":"x"},"tags":["a"]}', []),
    ("oneOf-distinct-types", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "true", "1", []),
    ("allOf-one", {"allOf": [{"type": "integer", "minimum": 3}]}, "1", "3", []),
    ("allOf-one-ref", {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer", "maximum": 3}}},
     "4", "3", []),
    ("enum-type-all-values-match", {"type": "string", "enum": ["a", "b"]}, '"c"', '"a"', []),
    ("const-type-matches", {"type": "string", "const": "a"}, '"b"', '"a"', []),
    ("type-list-string-null-maxLength", {"type": ["string", "null"], "maxLength": 2}, '"abc"', "null", []),
    ("type-list-string-null-maxLength-str", {"type": ["string", "null"], "maxLength": 2}, '"abc"', '"ab"', []),
    ("type-list-integer-null-minimum", {"type": ["integer", "null"], "minimum": 2}, "1", "2", []),
    ("type-list-object-null-required", {"type": ["object", "null"], "properties": {"a": {"type": "integer"}},
                                        "required": ["a"]}, "{}", '{"a":1}', []),
    ("nested-objects-required", {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}}},
     '{"a":{}}', '{"a":{"b":1}}', []),
    ("enum", {"enum": ["x", 1, None]}, "2", "1", []),
    ("const-object", {"const": {"a": 1}}, '{"a":2}', '{"a":1}', []),
    ("items-maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     "[1,2,3]", "[1]", []),
    ("items-minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     "[]", "[1,2]", []),
    ("items-type", {"type": "array", "items": {"type": "integer"}}, '["x"]', "[1]", []),
    ("prefixItems-items-false", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                                 "items": False}, '[1,"a",2]', '[1,"a"]', []),
    ("pattern", {"type": "string", "pattern": "^a[0-9]+$"}, '"ab"', '"a12"', []),
    ("minLength-maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, '"a"', '"ab"', []),
    ("integer-bounds", {"type": "integer", "minimum": 1, "maximum": 10}, "11", "10", []),
    ("integer-exclusive-bounds", {"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 10}, "1", "2", []),
    ("number-bounds", {"type": "number", "minimum": 0.5, "maximum": 10}, "0.25", "0.75", []),
    ("number-exclusive-maximum", {"type": "number", "exclusiveMaximum": 1.5}, "1.5", "1.25", []),
    ("additionalProperties-false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, '{"b":1}', '{"a":1}', []),
    ("additionalProperties-schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": {"type": "string"}}, '{"b":1}', '{"a":1,"b":"x"}', []),
    ("unevaluatedProperties-false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"], "unevaluatedProperties": False},
     '{"a":1,"b":2}', '{"a":1}', []),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, '{"y":1}', '{"x":1}', []),
    ("min-maxProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "additionalProperties": {"type": "integer"}, "minProperties": 2, "maxProperties": 3},
     '{"a":1}', '{"a":1,"b":2}', []),
    ("propertyNames-typed-alone", {"type": "object", "additionalProperties": {"type": "integer"},
                                   "propertyNames": {"type": "string", "maxLength": 1}}, '{"ab":1}', '{"a":1}', []),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 3}]}, "1", "3", []),
    ("ref-chain", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                                   "b": {"type": "string", "maxLength": 1}}}, '"ab"', '"a"', []),
    ("recursive-ref", {"$defs": {"n": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
     '{"v":1,"next":{}}', '{"v":1,"next":{"v":2}}', []),
    # formats: every format the server's validator asserts (ASSERTED_FORMATS)
    ("format-date-time", _fmt("date-time"), '"2024-13-01T00:00:00Z"', '"2024-01-01T00:00:00Z"', []),
    ("format-date", _fmt("date"), '"2024-13-01"', '"2024-02-29"', []),
    ("format-time", _fmt("time"), '"24:00:00Z"', '"12:00:00+01:00"', []),
    ("format-duration", _fmt("duration"), '"PT"', '"P1DT2H"', []),
    ("format-email", _fmt("email"), '"a..b@c.com"', '"a@b.com"', []),
    ("format-hostname", _fmt("hostname"), '"a..b"', '"a.b"', []),
    ("format-ipv4", _fmt("ipv4"), '"256.1.1.1"', '"10.0.0.1"', []),
    ("format-ipv6", _fmt("ipv6"), '"1::2::3"', '"::1"', []),
    ("format-uuid", _fmt("uuid"), '"123e4567e89b12d3a456426614174000"',
     '"123e4567-e89b-12d3-a456-426614174000"', []),
    ("format-uri", _fmt("uri"), '"no scheme"', '"http://x.y/z"', []),

    ("propertyNames-untyped-subschema", {"type": "object", "additionalProperties": {"type": "integer"},
                                         "propertyNames": {"maxLength": 1}}, '{"ab":1}', '{"a":1}', []),
    # found by this table (analyzer bugs once): xgrammar widens here.
    pytest.param("required-name-not-in-properties", _obj(additionalProperties={"type": "integer"},
                                                         required=["a", "c"]),
                 '{"a":1}', '{"a":1,"c":2}', ["required at #"]),
    pytest.param("required-without-properties", {"type": "object", "additionalProperties": {"type": "integer"},
                                                 "required": ["a"]},
                 "{}", '{"a":1}', ["required at #"]),
    pytest.param("patternProperties-overlapping-a-property", {
        "type": "object", "properties": {"ab": {"type": "integer"}},
        "patternProperties": {"b$": {"type": "integer", "minimum": 5}}}, '{"ab":1}', '{"ab":7}',
        ["patternProperties at #"]),
    pytest.param("format-email-with-pattern", _fmt("email", pattern="^a"), '"b@c.com"', '"a@c.com"',
                 ["pattern at #"]),
    pytest.param("format-json-pointer-with-pattern", _fmt("json-pointer", pattern="^/a"), '"/b"', '"/a"',
                 ["pattern at #"]),
    # xgrammar 0.2.8 enforced it on an untyped schema; 0.2.9 does not: a real gap now.
    ("untyped-maxItems", {"maxItems": 1}, "[1,2]", "[1]", ["maxItems at #"]),
]

# Formats whose grammars (xgrammar's and llguidance's) check only the syntax: the grammar
# stays exact for `strict` (as OpenAI's strict formats are), and the frontend validates every
# such document anyway (needs_format_check), so a value like 2024-02-30 is never "stop".
SYNTAX_ONLY_FORMATS = [
    ("date", '"2024-02-30"', '"2024-02-29"'), ("date-time", '"2023-02-29T00:00:00Z"', '"2024-02-29T00:00:00Z"'),
    ("time", '"22:59:60+01:00"', '"23:59:60Z"'), ("hostname", '"' + "a" * 64 + '.com"', '"a.com"'),
    ("ipv4", '"01.1.1.1"', '"1.1.1.1"'), ("ipv6", '"::ffff:1.2.3.04"', '"::ffff:1.2.3.4"'),
]


@pytest.mark.parametrize("fmt, invalid, valid", SYNTAX_ONLY_FORMATS, ids=[c[0] for c in SYNTAX_ONLY_FORMATS])
def test_syntax_only_formats_are_validated_even_when_exact(fmt, invalid, valid):
    schema = {"type": "object", "properties": {"f": _fmt(fmt)}, "required": ["f"]}
    assert xgrammar_gaps(schema) == []
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    assert _is_grammar_accept_string(grammar, '{"f":%s}' % invalid)  # the grammar admits it ...
    assert violation(schema, '{"f":%s}' % invalid) is not None  # ... the validator does not
    assert violation(schema, '{"f":%s}' % valid) is None
    assert needs_format_check(json.dumps(schema, separators=(",", ":")))
    assert not needs_format_check(json.dumps({"type": "string", "format": "uuid"}))


# Gaps the analyzer claims that xgrammar (0.2.9) does enforce: safe (the schema goes to
# llguidance or is validated), but not real. Pinned so a change in either shows up here.
CONSERVATIVE = [
    ("multipleOf-integer-unbounded", {"type": "integer", "multipleOf": 3}, "4", "6", ["multipleOf at #"]),
    ("multipleOf-integer-small-range", {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 3},
     "4", "6", ["multipleOf at #"]),
    ("propertyNames-with-patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                                              "propertyNames": {"type": "string", "maxLength": 1}},
     '{"xyz":1}', '{"x":1}', ["propertyNames at #"]),
    ("untyped-properties", {"properties": {"a": {"type": "integer"}}}, '{"a":"x"}', '{"a":1}', ["properties at #"]),
]


def _params(cases):
    return [c if hasattr(c, "marks") else pytest.param(*c) for c in cases]


def _ids(cases):
    return [(c.values if hasattr(c, "marks") else c)[0] for c in cases]


@pytest.mark.parametrize("name, schema, invalid, valid, gaps", _params(CASES), ids=_ids(CASES))
def test_xgrammar_gap_claims_match_xgrammar(name, schema, invalid, valid, gaps):
    broken = violation(schema, invalid)
    assert broken is not None, f"{invalid} must be invalid"
    assert violation(schema, valid) is None, f"{valid} must be valid"
    assert xgrammar_accepts(schema, valid)  # the grammar is not vacuous
    if gaps:  # the gap is real: xgrammar admits a document only a dropped keyword rejects
        assert xgrammar_accepts(schema, invalid)
        assert blamed_on_a_gap(broken, gaps), broken
    else:  # exact: this invalid document is out of the grammar
        assert not xgrammar_accepts(schema, invalid)
    assert gap_strings(schema) == gaps


@pytest.mark.parametrize("name, schema, invalid, valid, gaps", CONSERVATIVE, ids=[c[0] for c in CONSERVATIVE])
def test_conservative_xgrammar_gaps(name, schema, invalid, valid, gaps):
    assert violation(schema, invalid) is not None and violation(schema, valid) is None
    assert gap_strings(schema) == gaps
    # xgrammar enforces the keyword after all: were it to stop, move the case to CASES
    assert not xgrammar_accepts(schema, invalid) and xgrammar_accepts(schema, valid)


def test_every_asserted_format_has_an_xgrammar_case():
    covered = {c[1]["format"] for c in CASES if not hasattr(c, "marks") and not c[4]
               and isinstance(c[1].get("format"), str)}
    assert covered == ASSERTED_FORMATS


# ---- 2. paths and property names -------------------------------------------------------------
def test_property_names_are_not_keywords():
    assert xgrammar_gaps({"type": "object", "properties": {"not": {"type": "integer"}}}) == []
    named = {"type": "object", "properties": {name: {"type": "string"} for name in (
        "not", "uniqueItems", "if", "contains", "$ref", "allOf", "oneOf", "minimum", "dependentRequired")}}
    assert xgrammar_gaps(named) == []
    assert keyword_gaps(named, {"uniqueItems", "not", "if", "oneOf"}) == []
    # a real keyword next to a property of the same name: only the keyword counts
    both = {"type": "object", "properties": {"uniqueItems": {"type": "boolean"},
                                             "t": {"type": "array", "uniqueItems": True}}}
    assert gap_strings(both) == ["uniqueItems at #/properties/t"]
    assert keyword_gaps(both, {"uniqueItems"}) == [Gap("uniqueItems", "#/properties/t")]


def test_data_is_never_schema():
    data = {"not": {}, "uniqueItems": True, "oneOf": [1, 2], "if": {}, "$ref": "#/x", "allOf": [{}, {}]}
    for schema in ({"enum": [data]}, {"const": data}, {"type": "object", "enum": [data]},
                   {"type": "object", "properties": {"a": {"type": "object", "default": data,
                                                           "examples": [data]}}}):
        assert xgrammar_gaps(schema) == [], schema
        assert keyword_gaps(schema, set(data)) == [], schema


def test_defs_count_only_when_referenced_with_their_own_path():
    unused = {"type": "integer", "$defs": {"x": {"type": "array", "uniqueItems": True}},
              "definitions": {"y": {"not": {}}}}
    assert xgrammar_gaps(unused) == [] and keyword_gaps(unused, {"uniqueItems", "not"}) == []
    used = {"type": "object", "properties": {"t": {"$ref": "#/$defs/x"}, "u": {"$ref": "#/definitions/y"},
                                             "w": {"$ref": "#/$defs/a~1b"}},
            "$defs": {"x": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                      "a/b": {"type": "integer", "not": {"const": 0}}},
            "definitions": {"y": {"type": "string", "pattern": "^a$", "minLength": 2}}}
    assert gap_strings(used) == ["not at #/$defs/a~1b", "uniqueItems at #/$defs/x", "minLength at #/definitions/y"]
    assert keyword_gaps(used, {"uniqueItems"}) == [Gap("uniqueItems", "#/$defs/x")]


def test_recursive_refs_terminate():
    linked = {"$defs": {"n": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/n"}, "v": {"type": "integer", "not": {"const": 0}}}}}, "$ref": "#/$defs/n"}
    assert gap_strings(linked) == ["not at #/$defs/n/properties/v"]
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "uniqueItems": True}}}
    assert gap_strings(tree) == ["uniqueItems at #/properties/kids"]
    mutual = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    assert xgrammar_gaps(mutual) == []


def test_exclusive_branches():
    assert exclusive_branches({}, [{"type": "string"}, {"type": "integer"}, {"type": "null"}])
    assert not exclusive_branches({}, [{"type": "integer"}, {"type": "number"}])
    assert not exclusive_branches({}, [{"type": "string"}, {"type": "string"}])
    assert not exclusive_branches({}, [])
    assert not exclusive_branches({}, {"type": "string"})
    assert exclusive_branches(PET, PET["properties"]["pet"]["oneOf"])
    enum_tag = lambda *values: {"type": "object", "required": ["k"], "properties": {"k": {"enum": list(values)}}}
    assert exclusive_branches({}, [enum_tag("a", "b"), enum_tag("c")])
    assert not exclusive_branches({}, [enum_tag("a", "b"), enum_tag("b")])  # "b" matches both
    assert not exclusive_branches({}, [{"$ref": "#/nowhere"}, {"type": "string"}])
    assert not exclusive_branches({}, [{"type": "object", "properties": {"k": {"const": "a"}}},  # k optional
                                       {"type": "object", "properties": {"k": {"const": "b"}}}])


# ---- 4. strict markers -----------------------------------------------------------------------
def test_strict_markers_round_trip():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec, strict = split_strict(json.dumps(with_strict(schema, True)))
    assert strict and json.loads(spec) == schema and STRICT_KEY not in spec
    assert with_strict(schema, False) is schema
    assert with_strict(True, False) is True
    plain = json.dumps(schema)
    assert split_strict(plain) == (plain, False)
    spec, strict = split_strict(json.dumps({**schema, STRICT_KEY: False}))
    assert not strict and json.loads(spec) == schema
    # the key as a name or as data is no marker
    for other in (json.dumps({"type": "object", "properties": {STRICT_KEY: {"type": "boolean"}}}),
                  json.dumps({"enum": [STRICT_KEY]}), json.dumps([STRICT_KEY])):
        assert split_strict(other) == (other, False)
    # the marker asserts nothing
    assert xgrammar_gaps(with_strict(schema, True)) == []


def test_strict_boolean_schemas():
    spec, strict = split_strict(json.dumps(with_strict(True, True)))
    assert strict and json.loads(spec) == {}
    spec, strict = split_strict(json.dumps(with_strict(False, True)))
    assert strict and json.loads(spec) == {"not": {}}
    assert gap_strings({"not": {}}) == ["not at #"]  # never served as exact by xgrammar


# ---- 3 and 5: the real backends ----------------------------------------------------------------
@pytest.fixture(scope="module")
def auto(smollm2_tokenizer):
    backend = AutoGrammarBackend.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, EOS, JsonOptions()))
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def guidance(auto) -> GuidanceBackend:
    """The GuidanceBackend auto built (GuidanceBackend.from_tokenizer): one llguidance
    tokenizer per module."""
    assert isinstance(auto.guidance, GuidanceBackend)
    return auto.guidance


LLGUIDANCE_GAPS = [
    ("uniqueItems", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                               "uniqueItems": True}}},
     ["uniqueItems at #/properties/tags"]),
    ("not", {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}},
     ["not at #/properties/n"]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, ["contains at #"]),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 1},
                       "properties": {"a": {"type": "integer"}}}, ["propertyNames at #"]),
    ("oneOf-overlapping", {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"},
                                                                           {"type": "number"}]}}},
     ["oneOf at #/properties/v"]),
    ("dependentRequired", _obj(dependentRequired={"a": ["b"]}), ["dependentRequired at #"]),
    ("two-keywords", {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "b": {"type": "integer", "not": {"const": 0}}}}, ["uniqueItems at #/properties/a", "not at #/properties/b"]),
    ("in-a-referenced-def", {"type": "object", "properties": {"t": {"$ref": "#/$defs/tags"}},
                             "$defs": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
     ["uniqueItems at #/$defs/tags"]),
    ("next-to-a-property-of-its-name", {"type": "object", "properties": {
        "uniqueItems": {"type": "boolean"}, "a/b": {"type": "array", "uniqueItems": True}}},
     ["uniqueItems at #/properties/a~1b"]),
]


@pytest.mark.parametrize("name, schema, gaps", LLGUIDANCE_GAPS, ids=[c[0] for c in LLGUIDANCE_GAPS])
def test_llguidance_names_what_it_drops(guidance, name, schema, gaps):
    spec = json.dumps(schema)
    value = guidance.compile_json_schema(spec, strict=False)
    assert list(value.stats.gaps) == gaps
    with pytest.raises(StrictSchemaError) as refused:
        guidance.compile_json_schema(spec, strict=True)
    assert [str(g) for g in refused.value.gaps] == gaps
    for gap in gaps:
        assert gap in str(refused.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "format": "date"}},
     "required": ["a"]},
    {"allOf": [{"type": "integer"}, {"minimum": 3}]},
    {"type": "number", "multipleOf": 0.5},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
               {"type": "object", "properties": {"b": {"type": "integer"}}}]},  # closed: disjoint
    {"type": "integer", "$defs": {"x": {"type": "array", "uniqueItems": True}}},  # unreferenced
    {"type": "object", "properties": {"v": {"type": "object", "enum": [{"uniqueItems": True}]}}},  # data
    PET,
], ids=["object", "allOf", "multipleOf", "oneOf-closed-objects", "unreferenced-def", "data", "pydantic-union"])
def test_llguidance_exact_schemas_compile_under_strict(guidance, schema):
    value = guidance.compile_json_schema(json.dumps(schema), strict=True)
    assert value.stats.gaps == ()


def test_llguidance_snowplow_schema(guidance):
    schema = {"$schema": SNOWPLOW, "self": {"vendor": "com.acme", "name": "e", "format": "jsonschema",
                                            "version": "1-0-0"},
              "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"],
              "additionalProperties": False}
    for strict in (False, True):
        assert guidance.compile_json_schema(json.dumps(schema), strict=strict).stats.gaps == ()


def test_llguidance_asserted_formats(guidance):
    """Each asserted format is either enforced (exact under strict) or reported as a gap."""
    unknown = []
    for name in sorted(ASSERTED_FORMATS):
        spec = json.dumps({"type": "object", "properties": {"f": {"type": "string", "format": name}}})
        gaps = guidance.compile_json_schema(spec, strict=False).stats.gaps
        if gaps:
            assert gaps == ("format at #/properties/f",), name
            with pytest.raises(StrictSchemaError, match="format at #/properties/f"):
                guidance.compile_json_schema(spec, strict=True)
            unknown.append(name)
        else:
            assert guidance.compile_json_schema(spec, strict=True).stats.gaps == ()
    if not unknown:
        pytest.skip("llguidance knows every asserted format: no unknown-format gap to observe")


def test_lenient_gaps_reads_llguidance_warnings():
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "i": {"type": "string", "format": "int64"},
                                               "t": {"type": "array", "uniqueItems": True}}}
    warnings = ['Unimplemented keys: ["uniqueItems"]', "Unknown format: date", "Unknown format: int64"]
    assert lenient_gaps(schema, warnings) == [Gap("uniqueItems", "#/properties/t"), Gap("format", "#/properties/d")]
    assert lenient_gaps(schema, ["Unknown format: int64"]) == []  # an annotation: nothing to break


def _llguidance_accepts(value, tokenizer, document: str) -> bool:
    matcher = value.matcher.deep_copy()
    ids = tokenizer.encode(document, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("fmt, invalid", [
    ("date", '"2024-02-30"'), ("date", '"2024-13-01"'), ("ipv4", '"01.1.1.1"'), ("email", '"a..b@c.com"'),
    ("hostname", '"' + "a" * 64 + '.com"'),
    # llguidance admits 2023-02-29, a leap second at any offset and a 300-octet hostname: like
    # xgrammar's, these formats are checked for syntax only, and validated (needs_format_check).
])
def test_llguidance_exact_formats_reject_invalid_values(guidance, smollm2_tokenizer, fmt, invalid):
    schema = _fmt(fmt)
    assert violation(schema, invalid) is not None
    value = guidance.compile_json_schema(json.dumps(schema), strict=True)  # claimed exact
    assert not _llguidance_accepts(value, smollm2_tokenizer, invalid)


# ---- 5. auto ---------------------------------------------------------------------------------
def _auto(auto, schema, strict=False):
    return auto.init_value(("json_schema", json.dumps(with_strict(schema, strict))))


def test_auto_exact_llguidance_first(auto):
    value = _auto(auto, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert value.stats.dispatch_type == "llguidance" and value.stats.gaps == ()
    value = _auto(auto, {"allOf": [{"type": "integer"}, {"minimum": 3}]})  # xgrammar would drop allOf
    assert value.stats.dispatch_type == "llguidance" and value.stats.gaps == ()
    strict = _auto(auto, {"allOf": [{"type": "integer"}, {"minimum": 3}]}, strict=True)
    assert strict.stats.dispatch_type == "llguidance" and strict.stats.gaps == ()


def test_auto_exact_only_for_xgrammar(auto):
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}}
    for strict in (False, True):  # llguidance refuses propertyNames; xgrammar enforces it here
        value = _auto(auto, schema, strict=strict)
        assert value.stats.dispatch_type.startswith("xgrammar (fallback: llguidance refused it") and value.stats.gaps == ()


def test_auto_approximates_uniqueItems(auto):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    value = _auto(auto, schema)
    assert not isinstance(value, InvalidGrammarObject)
    assert value.stats.dispatch_type.startswith("llguidance (approximate: llguidance refused it")
    assert value.stats.gaps == ("uniqueItems at #/properties/tags",)
    refused = _auto(auto, schema, strict=True)
    assert isinstance(refused, InvalidGrammarObject)
    assert "uniqueItems at #/properties/tags" in refused.message and "strict" in refused.message


def test_auto_pydantic_union_is_exact_under_strict(auto):
    value = _auto(auto, PET, strict=True)
    assert not isinstance(value, InvalidGrammarObject), getattr(value, "message", "")
    assert value.stats.dispatch_type == "llguidance" and value.stats.gaps == ()
    assert xgrammar_gaps(PET) == []  # exact under --grammar-backend xgrammar too
