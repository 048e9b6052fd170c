"""Which grammar library serves a structural tag, and what each JSON part loses there.

One grammar serves the whole tag, so one library reads every part: the plan picks it the
way auto picks one for a json_schema (schema_coverage.py decides what is exact), with one
rule more: a part that must be exact (``strict``, or a part outside a ``tag`` that the
frontend cannot find again to validate) must be exact in the library chosen. The HTTP
frontend runs the same plan before a response starts, so ``strict`` is a 400 before any
byte is sent; it needs no tokenizer (guidance_json.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from constrained.grammar_config import JsonOptions
from constrained.guidance_json import guidance_gaps
from constrained.schema_coverage import StrictSchemaError, xgrammar_gaps
from constrained.tag_parts import TagPart

# A reading: per part, (gaps, lenient) -- or None where the library refuses the part.
Reading = list[Optional[tuple[list, bool]]]


@dataclass(frozen=True)
class TagPlan:
    library: str  # "xgrammar" or "llguidance"
    lenient: tuple[bool, ...]  # per part: llguidance's lenient mode (an approximation)
    gaps: tuple[str, ...]  # "keyword at #/path in <part>": GrammarStats.gaps

    @property
    def exact(self) -> bool:
        return not self.gaps


class StrictPartError(StrictSchemaError):
    """A part that must be exact cannot be; ``part`` is the one named."""

    def __init__(self, part: TagPart, gaps: list, who: str) -> None:
        super().__init__(gaps, who)
        self.part = part
        if part.strict:
            self.args = (f"{part.name}: {self.args[0]}",)
        else:
            listed = ", ".join(str(g) for g in self.gaps[:20]) or "it cannot tell"
            self.args = (f"{part.name}: a json_schema outside a tag is not found again in the output to be "
                         f"validated, so only a grammar that enforces every keyword of its schema can serve "
                         f"it, but {who}: {listed}. Put it inside a tag (begin, content, end).",)


# Pythonic keyword arguments have no library grammar: ours (constrained/pythonic_args.py)
# follows the properties and their types only, so such a part is never exact.
PYTHONIC_GAP = "all but the arguments' names and types (pythonic arguments) at #"


_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")


def _qwen_xml_gaps(schema) -> list[str]:
    """xgrammar's qwen_xml style writes strings raw, newlines around them optional and
    counted or not: a string's length, pattern and format are not enforced on the value
    the parser reads back (measured: minLength 3 accepts "\na\n")."""
    gaps = []
    props = schema.get("properties") if isinstance(schema, dict) else None
    for key, prop in (props or {}).items():
        kinds = prop.get("type") if isinstance(prop, dict) else None
        if kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
            gaps += [f"{k} at #/properties/{key} (qwen_xml raw string)" for k in _STRING_KEYWORDS if k in prop]
    return gaps


def xgrammar_reading(parts: list[TagPart]) -> Reading:
    def gaps(p: TagPart) -> list[str]:
        if p.style == "pythonic":
            return [PYTHONIC_GAP]
        return xgrammar_gaps(p.schema) + (_qwen_xml_gaps(p.schema) if p.style == "qwen_xml" else [])
    return [(gaps(p), False) for p in parts]


def guidance_reading(parts: list[TagPart], opts: JsonOptions) -> Reading:
    out: Reading = []
    for p in parts:
        try:
            out.append(guidance_gaps(json.dumps(p.schema), opts))
        except (ValueError, TypeError):
            out.append(None)
    return out


def _blocker(parts: list[TagPart], reading: Reading) -> Optional[TagPart]:
    """The first part this reading cannot serve: refused, or inexact where it must be exact."""
    for p, r in zip(parts, reading):
        if r is None or (p.must_be_exact and r[0]):
            return p
    return None


def _plan(library: str, parts: list[TagPart], reading: Reading) -> TagPlan:
    gaps = tuple(f"{g} in {p.name}" for p, r in zip(parts, reading) for g in r[0])
    return TagPlan(library, tuple(r[1] for r in reading), gaps)


def _total(reading: Reading) -> int:
    return sum(len(r[0]) for r in reading)


def plan_tag(parts: list[TagPart], backend: str, opts: JsonOptions) -> TagPlan:
    """The plan for ``backend`` ("xgrammar", "llguidance" or "auto"). StrictPartError when a
    part that must be exact cannot be; ValueError when llguidance refuses a part outright."""
    styled = sorted({p.style for p in parts} - {"json"})
    if styled and backend == "llguidance":
        raise ValueError(f"structural_tag parts in the {styled[0]} style need the xgrammar grammar backend "
                         "(llguidance has no grammar for them)")
    if backend == "xgrammar" or (styled and backend == "auto"):
        reading = xgrammar_reading(parts)
        blocker = _blocker(parts, reading)
        if blocker is not None:
            raise StrictPartError(blocker, reading[blocker.index][0], "no grammar library enforces" if styled and backend == "auto"
                                  else "the xgrammar grammar backend does not enforce")
        return _plan("xgrammar", parts, reading)
    if backend == "llguidance":
        reading = guidance_reading(parts, opts)
        blocker = _blocker(parts, reading)
        if blocker is not None and reading[blocker.index] is None:
            guidance_gaps(json.dumps(blocker.schema), opts)  # raises llguidance's reason
        if blocker is not None:
            raise StrictPartError(blocker, reading[blocker.index][0], "the llguidance grammar backend does not enforce")
        return _plan("llguidance", parts, reading)
    if backend != "auto":
        raise ValueError(f"no structural-tag plan for the {backend} grammar backend")
    x = xgrammar_reading(parts)
    if not _total(x):  # xgrammar first for tags (as before): exact everywhere
        return _plan("xgrammar", parts, x)
    g = guidance_reading(parts, opts)
    ok = {name: r for name, r in (("xgrammar", x), ("llguidance", g)) if _blocker(parts, r) is None}
    if ok:  # the one dropping fewer keywords; xgrammar on a tie
        library = min(ok, key=lambda name: (_total(ok[name]), name != "xgrammar"))
        return _plan(library, parts, ok[library])
    blocker = _blocker(parts, x)
    closer = x[blocker.index][0]
    if g[blocker.index] is not None and len(g[blocker.index][0]) < len(closer):
        closer = g[blocker.index][0]
    raise StrictPartError(blocker, closer, "no grammar library enforces")
