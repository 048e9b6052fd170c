"""vLLM's structured-output dialect on the OpenAI endpoints, and the one place where every
way a request can ask for a constraint resolves into a single (kind, spec).

vLLM's fields map onto our constraint kinds (``sampling.sampling_params.CONSTRAINT_FIELDS``):

==============================================  ==============  ===========================
vLLM field                                      our kind        accepted values
==============================================  ==============  ===========================
``structured_outputs.json``, ``guided_json``     json_schema     a schema object, or JSON text
``structured_outputs.json_object: true``         json_schema     the schema ``{"type": "object"}``
``structured_outputs.regex``, ``guided_regex``   regex           a string
``structured_outputs.choice``, ``guided_choice`` choice          a list of non-empty strings
``structured_outputs.grammar``, ``guided_grammar``  ebnf         EBNF/GBNF text (``root ::= ...``)
``structured_outputs.structural_tag``            structural_tag  an object, or JSON text
==============================================  ==============  ===========================

Options of a JSON constraint (a 400 with any other kind, never ignored):
``disable_any_whitespace: true`` (compact separators, no whitespace between JSON tokens),
``whitespace_pattern`` / ``guided_whitespace_pattern`` (a regex for the whitespace between
JSON tokens; llguidance, outlines and auto serve it, xgrammar refuses it) -- both go into
the spec (``grammar_config.JSON_LAYOUT_KEY``), so into the grammar cache key, and replace
the server's ``--constrained-json-*`` whitespace flags for that request -- and
``disable_additional_properties: true``, which rewrites the schema as vLLM does: every
object schema listing ``properties`` or ``patternProperties`` without
``additionalProperties`` gets ``additionalProperties: false`` (not inside ``allOf``, where
closing each branch would make the conjunction unsatisfiable).

One constraint per request, whichever dialect gives it: two fields that both give one
(``response_format`` and ``guided_json``, ``structured_outputs.regex`` and ``regex``, ...)
are a 400 naming both, as two kinds through our own fields always were.
"""
from __future__ import annotations

import copy
from typing import Any, NamedTuple, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from constrained.grammar_config import with_json_layout
from constrained.json_input import load_json_text
from sampling.sampling_params import SamplingParams

_DATA_KEYS = ("enum", "const", "default", "examples")  # values, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams``)."""

    model_config = ConfigDict(extra="forbid")
    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[dict[str, Any], str]] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None


class VllmDialectFields(BaseModel):
    """The vLLM request fields shared by chat and text completions (a base of
    ``openai_protocol._SamplingRequest``)."""

    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None


class ConstraintSource(NamedTuple):
    field: str  # the request field, as the user wrote it (for messages)
    kind: str  # one of CONSTRAINT_FIELDS
    spec: Any


# (structured_outputs attribute, its name in requests, our kind); the legacy top-level names.
_STRUCTURED = (("json_", "json", "json_schema"), ("regex", "regex", "regex"),
               ("choice", "choice", "choice"), ("grammar", "grammar", "ebnf"),
               ("structural_tag", "structural_tag", "structural_tag"))
_GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "ebnf"))
_NATIVE = ("json_schema", "regex", "ebnf", "choice")  # our own top-level fields, in CONSTRAINT_FIELDS order


def request_constraint(req: Any, response_format: Optional[tuple[str, Any]] = None) -> dict[str, Any]:
    """Every constraint field of an OpenAI request ``req`` (both dialects; ``response_format``:
    its already-mapped (kind, spec)) -> ``{kind: spec}`` for SamplingParams, or {} for none.
    Raises ValueError (a 400) naming the fields at fault."""
    sources = constraint_sources(req, response_format)
    if len(sources) > 1:
        names = " and ".join(s.field for s in sources)
        if len({s.kind for s in sources}) > 1:
            raise ValueError(f"Only one constraint kind per request is allowed, got {names}.")
        raise ValueError(f"{names} {'both' if len(sources) == 2 else 'all'} give a constraint: use one.")
    source = sources[0] if sources else None
    options = _json_options(req)
    if options:
        field = options[0][0]
        if source is None or source.kind != "json_schema":
            got = f"a {source.kind} constraint ({source.field})" if source else "no constraint"
            raise ValueError(f"{field} applies to JSON constraints only (json, json_object, guided_json, "
                             f"response_format json_schema/json_object), but the request has {got}.")
        source = source._replace(spec=apply_json_options(source, dict(options)))
    return {} if source is None else {source.kind: source.spec}


def constraint_sources(req: Any, response_format: Optional[tuple[str, Any]] = None) -> list[ConstraintSource]:
    """The fields of ``req`` that give a constraint, in a fixed order (ours first)."""
    sources = []
    if response_format is not None:
        sources.append(ConstraintSource("response_format", *response_format))
    for name in _NATIVE:
        if getattr(req, name, None) is not None:
            sources.append(ConstraintSource(name, name, getattr(req, name)))
    so: Optional[StructuredOutputs] = getattr(req, "structured_outputs", None)
    if so is not None:
        for attr, name, kind in _STRUCTURED:
            if getattr(so, attr) is not None:
                sources.append(_vllm_source(f"structured_outputs.{name}", kind, getattr(so, attr)))
        if so.json_object:  # false: no constraint
            sources.append(ConstraintSource("structured_outputs.json_object", "json_schema", {"type": "object"}))
    for name, kind in _GUIDED:
        if getattr(req, name, None) is not None:
            sources.append(_vllm_source(name, kind, getattr(req, name)))
    return sources


def _vllm_source(field: str, kind: str, spec: Any) -> ConstraintSource:
    """Validate a vLLM-dialect value now, so its 400 names the field it came in."""
    if kind in ("json_schema", "structural_tag") and isinstance(spec, str):
        spec = load_json_text(spec, field)
    try:
        SamplingParams.from_dict({kind: spec})
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    return ConstraintSource(field, kind, spec)


def _json_options(req: Any) -> list[tuple[str, Any]]:
    """[(field, value)] of the JSON options ``req`` sets (neutral values left out)."""
    so: Optional[StructuredOutputs] = getattr(req, "structured_outputs", None)
    given = []
    if so is not None:
        if so.disable_any_whitespace:
            given.append(("structured_outputs.disable_any_whitespace", True))
        if so.whitespace_pattern is not None:
            given.append(("structured_outputs.whitespace_pattern", so.whitespace_pattern))
        if so.disable_additional_properties:
            given.append(("structured_outputs.disable_additional_properties", True))
    if getattr(req, "guided_whitespace_pattern", None) is not None:
        given.append(("guided_whitespace_pattern", req.guided_whitespace_pattern))
    whitespace = [f for f, _ in given if not f.endswith("disable_additional_properties")]
    if len(whitespace) > 1:
        raise ValueError(f"{' and '.join(whitespace)} both set the whitespace between JSON tokens: use one.")
    return given


def apply_json_options(source: ConstraintSource, options: dict[str, Any]) -> Any:
    """The json_schema spec of ``source`` with the request's JSON options applied."""
    schema = source.spec
    if isinstance(schema, str):  # our own json_schema field: JSON text
        schema = load_json_text(schema, source.field)
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{source.field} must be a JSON object, got {type(schema).__name__}")
    if options.get("structured_outputs.disable_additional_properties"):
        schema = close_object_schemas(schema)
    pattern = next((v for f, v in options.items() if f.endswith("whitespace_pattern")), None)
    return with_json_layout(schema, bool(options.get("structured_outputs.disable_any_whitespace")), pattern)


def close_object_schemas(schema: Any) -> Any:
    """vLLM's ``disable_additional_properties``: a copy of ``schema`` where every object
    schema with ``properties`` or ``patternProperties`` and no ``additionalProperties``
    (nor ``unevaluatedProperties``) gets ``additionalProperties: false``. Not inside
    ``allOf``, nor in a definition an ``allOf`` refers to: closing each branch of a
    conjunction would make it unsatisfiable (the backends' own closing does the same)."""
    shared: set[str] = set()
    _all_of_refs(schema, False, shared)
    out = copy.deepcopy(schema)
    _close(out, "#", False, shared)
    return out


def _all_of_refs(node: Any, in_all_of: bool, found: set[str]) -> None:
    items = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ()
    for key, value in items:
        if in_all_of and key == "$ref" and isinstance(value, str):
            found.add(value)
        elif key not in _DATA_KEYS:
            _all_of_refs(value, in_all_of or key == "allOf", found)


def _close(node: Any, path: str, in_all_of: bool, shared: set[str]) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _close(item, f"{path}/{i}", in_all_of, shared)
        return
    if not isinstance(node, dict):
        return
    in_all_of = in_all_of or path in shared
    for key, value in node.items():
        sub = f"{path}/{_escape(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema, not a schema
            for name, schema in value.items():
                _close(schema, f"{sub}/{_escape(name)}", in_all_of, shared)
        elif key not in _DATA_KEYS:
            _close(value, sub, in_all_of or key == "allOf", shared)
    if (("properties" in node or "patternProperties" in node) and not in_all_of
            and "additionalProperties" not in node and "unevaluatedProperties" not in node):
        node["additionalProperties"] = False


def _escape(key: Any) -> str:  # a JSON-pointer segment
    return str(key).replace("~", "~0").replace("/", "~1")
