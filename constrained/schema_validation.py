"""Check finished JSON documents against the FULL request schema, with jsonschema-rs.

A json_schema request's grammar can be an approximation of its schema (a grammar library drops
keywords such as ``uniqueItems`` or ``not``), so the HTTP frontend checks the finished document
with a real validator and reports a violation instead of success. Validators are compiled once
per schema text and cached. Why jsonschema-rs (benchmark/bench_schema_validation.py, 80 corpus
schemas): the fastest to validate (median ~3 us a valid document, ~6 us an invalid one with its
error; python-jsonschema 10-20x and fastjsonschema ~2x slower) and to build (~30 us; both others
50-70x slower), far under the 1 ms target; drafts 4 to 2020-12 (fastjsonschema stops at 7 and
reads 2020-12 schemas wrongly); every format the grammars constrain checked without extra
packages; and each error carries its keyword, instance path and schema-document path.

Policy:
- draft: the schema's own ``$schema`` when jsonschema-rs knows it, else 2020-12 (Snowplow's
  iglu ``$schema`` URIs included), without warnings or fetching the meta-schema;
- no network, ever: ``offline=True``, so a remote (or file:) ``$ref`` fails the build, which
  raises ValueError;
- formats: asserted for those both grammar libraries (xgrammar, llguidance) constrain (a document
  they shaped satisfies them, and a dropped ``format`` is caught); the other formats known to
  jsonschema-rs stay annotations as in 2019-09+; unknown formats (``int64``) are ignored;
- one error per document: the first in jsonschema-rs's evaluation order (``validate`` stops
  there, so it is also the cheapest), which depends only on the schema and the document, not
  on the order of the schema's keys.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Optional, Union

import jsonschema_rs

ASSERTED_FORMATS = frozenset(
    {"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
# jsonschema-rs's other built-in formats, overridden to always pass (annotation only).
_ANNOTATION_ONLY_FORMATS = {
    name: (lambda _value: True)
    for name in ("idn-email", "idn-hostname", "iri", "iri-reference", "json-pointer",
                 "relative-json-pointer", "regex", "uri-reference", "uri-template")}
# Schema keywords whose members are named by the user: ['properties', 'a'] ends in a name.
_NAMED_MEMBERS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})


@dataclass(frozen=True)
class SchemaViolation:
    message: str  # the validator's message
    keyword: str  # the failing keyword, e.g. "uniqueItems"; "json" when the text is not JSON
    path: str  # JSON pointer into the document, "#/tags/1" ("#" for the root)
    schema_path: str  # JSON pointer into the schema document, "#/properties/tags/uniqueItems"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SchemaValidationStats:
    compiled: int  # validator builds (cache misses), failed builds included
    hits: int  # lookups served from the cache
    validations: int  # documents checked
    entries: int  # schemas cached now


def _pointer(parts) -> str:
    """RFC 6901 pointer, as a '#' fragment (not percent-encoded)."""
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _keyword(err: jsonschema_rs.ValidationError) -> str:
    # The schema path ends at the failing keyword: dependentRequired and if/then report "required"
    # as their kind, but their path says ['dependentRequired'] and ['then', 'required']. A path
    # ending in a user name (a false subschema under 'properties') falls back to the kind.
    path = err.schema_path
    if path and isinstance(path[-1], str) and (len(path) == 1 or path[-2] not in _NAMED_MEMBERS):
        return path[-1]
    return err.kind.name


def _not_json_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


_PY_ANCHOR = re.compile(r"(?<!\\)((?:\\\\)*)\\([AZ])")


def _ecma_anchors(node):
    """Patterns with Python's ``\\A`` / ``\\Z`` (real schemas have them; xgrammar reads them)
    as ECMA-262's ``^`` / ``$``, the same anchors, so the validator can build them."""
    if isinstance(node, list):
        return [_ecma_anchors(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):  # data, not schema
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = _PY_ANCHOR.sub(lambda m: m.group(1) + ("^" if m.group(2) == "A" else "$"), value)
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {_ecma_anchors({"pattern": k})["pattern"]: _ecma_anchors(v) for k, v in value.items()}
        else:
            out[key] = _ecma_anchors(value)
    return out


def _build(schema_text: str) -> Union[jsonschema_rs.Validator, str]:
    """The validator, or the reason it cannot be built (cached too: a bad schema fails fast)."""
    try:
        schema = json.loads(schema_text, parse_constant=_not_json_constant)
    except (ValueError, RecursionError) as e:
        return f"the schema is not JSON: {e}"
    if not isinstance(schema, (dict, bool)):
        return "a JSON schema must be an object or a boolean"
    schema = _ecma_anchors(schema)
    try:
        cls = jsonschema_rs.validator_cls_for(schema)  # unknown $schema -> Draft202012Validator
        return cls(schema, validate_formats=True, formats=_ANNOTATION_ONLY_FORMATS, offline=True)
    except Exception as e:  # meta-schema violation, unresolvable or remote $ref, bad regex
        where = getattr(e, "instance_path", None)
        at = f" (at {_pointer(where)})" if where else ""
        return f"{str(e).splitlines()[0] if str(e) else type(e).__name__}{at}"


class SchemaValidators:
    """Validators compiled once per schema (LRU, thread-safe), for finished documents."""

    def __init__(self, max_entries: int = 512) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Union[jsonschema_rs.Validator, str]] = OrderedDict()
        self._compiled = self._hits = self._validations = 0

    def _validator(self, schema_text: str) -> jsonschema_rs.Validator:
        with self._lock:
            entry = self._cache.get(schema_text)
            if entry is not None:
                self._cache.move_to_end(schema_text)
                self._hits += 1
        if entry is None:
            entry = _build(schema_text)  # outside the lock: a large schema takes a while
            with self._lock:
                self._compiled += 1
                self._cache[schema_text] = entry
                self._cache.move_to_end(schema_text)
                while len(self._cache) > self._max_entries:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise ValueError(entry)
        return entry

    def check_schema(self, schema_text: str) -> None:
        """ValueError (a 400) when the schema is not a valid JSON Schema; the validator it
        builds stays cached for the request's document."""
        try:
            self._validator(schema_text)
        except ValueError as e:
            raise ValueError(f"json_schema is not a valid JSON Schema: {e}") from None

    def validate(self, schema_text: str, document: str) -> Optional[SchemaViolation]:
        """None when ``document`` satisfies the schema. ValueError when the schema cannot be built."""
        validator = self._validator(schema_text)
        with self._lock:
            self._validations += 1
        try:  # NaN / Infinity are Python's extensions, not JSON
            instance = json.loads(document, parse_constant=_not_json_constant)
        except (ValueError, RecursionError) as e:
            return SchemaViolation(f"not JSON: {e}", "json", "#", "#")
        try:
            validator.validate(instance)
        except jsonschema_rs.ValidationError as err:
            return SchemaViolation(err.message, _keyword(err), _pointer(err.instance_path),
                                   _pointer(err.schema_path))
        return None

    @property
    def stats(self) -> SchemaValidationStats:
        with self._lock:
            return SchemaValidationStats(self._compiled, self._hits, self._validations,
                                         len(self._cache))
