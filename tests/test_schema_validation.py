"""constrained/schema_validation.py: finished documents checked against the full schema with the
real jsonschema-rs validator (no mocks): the reported keyword and paths, the per-schema cache,
drafts, and no network for remote references."""
from __future__ import annotations

import json
import threading
import time

import pytest

from constrained.schema_validation import SchemaValidators, SchemaViolation

SNOWPLOW = "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#"
ARTICLE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "uniqueItems": True},
        "published": {"type": "string", "format": "date-time"},
    },
    "required": ["title", "tags"],
    "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$"}},
}


def check(schema, document) -> SchemaViolation | None:
    return SchemaValidators().validate(json.dumps(schema), json.dumps(document))


def test_valid_document_is_none():
    assert check(ARTICLE, {"title": "t", "tags": ["a", "b"], "published": "2024-05-01T12:00:00Z"}) is None


@pytest.mark.parametrize("schema, document, keyword, path, schema_path", [
    (ARTICLE, {"title": "t", "tags": ["a", "a"]}, "uniqueItems", "#/tags", "#/properties/tags/uniqueItems"),
    (ARTICLE, {"title": "t", "tags": ["a", "B"]}, "pattern", "#/tags/1", "#/$defs/tag/pattern"),
    ({"properties": {"a": {"not": {"type": "string"}}}}, {"a": "s"}, "not", "#/a", "#/properties/a/not"),
    ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, 3, "oneOf", "#", "#/oneOf"),  # both branches
    ({"patternProperties": {"^x-": {"type": "integer"}}}, {"x-a": "s"},
     "type", "#/x-a", "#/patternProperties/^x-/type"),
    ({"if": {"properties": {"k": {"const": 1}}}, "then": {"required": ["b"]}, "else": {"required": ["c"]}},
     {"k": 1, "c": 0}, "required", "#", "#/then/required"),
    ({"if": {"properties": {"k": {"const": 1}}}, "then": {"required": ["b"]}, "else": {"required": ["c"]}},
     {"k": 2, "b": 0}, "required", "#", "#/else/required"),
    ({"dependentRequired": {"a": ["b"]}}, {"a": 1}, "dependentRequired", "#", "#/dependentRequired"),
    ({"properties": {"a/b~c": {"type": "integer"}}}, {"a/b~c": "x"},  # RFC 6901 escapes
     "type", "#/a~1b~0c", "#/properties/a~1b~0c/type"),
    ({"properties": {"a": False}}, {"a": 1}, "falseSchema", "#/a", "#/properties/a"),
    ({"format": "date-time"}, "yesterday", "format", "#", "#/format"),  # asserted, not annotation
])
def test_violation_keyword_and_paths(schema, document, keyword, path, schema_path):
    v = check(schema, document)
    assert v is not None and (v.keyword, v.path, v.schema_path) == (keyword, path, schema_path), v
    assert v.message and v.to_json() == {"message": v.message, "keyword": keyword, "path": path,
                                         "schema_path": schema_path}


def test_formats_outside_the_grammar_set_stay_annotations():
    assert check({"format": "regex"}, "(") is None  # the grammars do not enforce it
    assert check({"type": "integer", "format": "int64"}, 5) is None  # unknown: ignored


@pytest.mark.parametrize("text", ['{"title": "t", "tags": [', "", "NaN", '{"a": 1} trailing'])
def test_text_that_is_not_json(text):
    v = SchemaValidators().validate(json.dumps(ARTICLE), text)
    assert v is not None and (v.keyword, v.path, v.schema_path) == ("json", "#", "#")


def test_a_schema_is_compiled_once_then_cached():
    sv, schema = SchemaValidators(), json.dumps(ARTICLE)
    assert sv.validate(schema, '{"title": "t", "tags": []}') is None
    assert (sv.stats.compiled, sv.stats.hits, sv.stats.validations) == (1, 0, 1)
    assert sv.validate(schema, '{"title": "t", "tags": ["x", "x"]}').keyword == "uniqueItems"
    assert (sv.stats.compiled, sv.stats.hits, sv.stats.validations) == (1, 1, 2)


def test_lru_evicts_the_least_recently_used():
    sv = SchemaValidators(max_entries=2)
    a, b, c = (json.dumps({"type": t}) for t in ("string", "integer", "boolean"))
    for schema, doc in ((a, '"s"'), (b, "1"), (a, '"s"'), (c, "true"), (a, '"s"'), (b, "2")):
        assert sv.validate(schema, doc) is None
    assert (sv.stats.compiled, sv.stats.hits, sv.stats.entries) == (4, 2, 2)  # b was evicted by c


def test_unknown_schema_uri_is_2020_12():
    schema = {"$schema": SNOWPLOW, "type": "object", "properties": {"pair": {"prefixItems": [{"type": "integer"}]}}}
    assert check(schema, {"pair": [1, "x"]}) is None
    v = check(schema, {"pair": ["x"]})  # prefixItems is 2020-12: a draft-7 reading would ignore it
    assert (v.keyword, v.path, v.schema_path) == ("type", "#/pair/0", "#/properties/pair/prefixItems/0/type")


def test_the_schema_own_draft_is_used():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "maximum": 3, "exclusiveMaximum": True}
    assert check(draft4, 3).keyword == "exclusiveMaximum"
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}}
    assert check(draft7, {"a": 1}).keyword == "dependencies"


@pytest.mark.parametrize("ref", ["http://10.255.255.1/schema.json", "https://example.com/s.json#/x",
                                 "file:///etc/hostname", "other.json"])
def test_remote_refs_are_never_fetched(ref):
    # 10.255.255.1 is unroutable: a fetch would hang for seconds instead of failing at once.
    schema = {"$id": "http://10.255.255.1/root.json", "properties": {"a": {"$ref": ref}}}
    sv, start = SchemaValidators(), time.monotonic()
    with pytest.raises(ValueError, match="Retrieval is disabled"):
        sv.validate(json.dumps(schema), '{"a": 1}')
    with pytest.raises(ValueError):  # the failure is cached too
        sv.validate(json.dumps(schema), '{"a": 1}')
    assert time.monotonic() - start < 1.0 and sv.stats.compiled == 1


@pytest.mark.parametrize("schema_text", ['{"type": "nonsense"}', '{"pattern": "(?<=x"}', "{bad", "[1]"])
def test_a_schema_the_validator_cannot_build_raises(schema_text):
    with pytest.raises(ValueError):
        SchemaValidators().validate(schema_text, "1")


def test_threads_share_one_cache():
    sv, schema, errors = SchemaValidators(), json.dumps(ARTICLE), []

    def worker():
        for i in range(200):
            doc = {"title": "t", "tags": ["a", "a" if i % 2 else "b"]}
            got = sv.validate(schema, json.dumps(doc))
            if (got is None) != (i % 2 == 0):
                errors.append(got)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sv.stats.validations == 800 and sv.stats.entries == 1
    assert sv.stats.compiled + sv.stats.hits == 800
