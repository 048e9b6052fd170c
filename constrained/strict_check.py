"""``strict`` decided before a response starts (the HTTP frontend calls ``check_strict``).

Whether a grammar library enforces every keyword of a schema is a static walk of the schema
(xgrammar: schema_coverage's whitelist; llguidance: its own check of the grammar text, no
tokenizer needed; outlines: its schema adapter), so the frontend answers a strict request
that cannot be served with a 400 -- also when it streams -- instead of a 200 whose first
event is an error. The ranks decide the same way when they compile, from the same functions.
"""
from __future__ import annotations

import json
from typing import Optional

from constrained.grammar_config import JsonOptions, json_layout
from constrained.guidance_json import guidance_gaps
from constrained.schema_coverage import StrictSchemaError, split_strict, xgrammar_gaps
from constrained.tag_parts import tag_parts
from constrained.tag_plan import plan_tag

_TAG_PLANS = ("xgrammar", "llguidance", "auto")


def strict_json_gaps(spec: str, backend: str, opts: JsonOptions) -> list:
    """What ``backend`` would drop from a json_schema spec ([]: it serves it exactly);
    ValueError when no library compiles it at all."""
    if backend == "xgrammar":
        return xgrammar_gaps(json.loads(spec))
    if backend == "llguidance":
        return guidance_gaps(spec, opts)[0]
    if backend == "outlines":
        from constrained.outlines_schema import adapt_schema

        adapt_schema(json.loads(spec))  # refuses (ValueError) every keyword it would not enforce
        return []
    if backend != "auto":
        raise StrictSchemaError([], f"the {backend} grammar backend does not say which keywords it enforces")
    try:  # auto_backend.compile_json_schema's order
        g_gaps, g_error = guidance_gaps(spec, opts)[0], None
    except ValueError as e:
        g_gaps, g_error = [], e
    if g_error is None and not g_gaps:
        return []
    only_guidance = opts.whitespace_pattern is not None or "whitespace_pattern" in (json_layout(spec) or {})
    x_gaps = xgrammar_gaps(json.loads(spec))
    if not only_guidance and not x_gaps:
        return []
    if g_error is not None:
        if only_guidance:
            raise g_error
        return x_gaps
    return g_gaps if only_guidance or len(g_gaps) <= len(x_gaps) else x_gaps


def check_strict(json_schema: Optional[str], structural_tag: Optional[str], backend: str,
                 opts: JsonOptions) -> None:
    """StrictSchemaError (a 400) when a strict json_schema, or a structural-tag part that must
    be exact (strict, or outside a ``tag``), cannot be served exactly by ``backend``."""
    if json_schema is not None:
        spec, strict = split_strict(json_schema)
        if strict:
            gaps = strict_json_gaps(spec, backend, opts)
            if gaps:
                who = "no grammar library enforces" if backend == "auto" else \
                    f"the {backend} grammar backend does not enforce"
                raise StrictSchemaError(gaps, who)
    if structural_tag is not None and backend in _TAG_PLANS:
        parts = tag_parts(json.loads(structural_tag))
        if any(p.must_be_exact for p in parts):
            plan_tag(parts, backend, opts)
