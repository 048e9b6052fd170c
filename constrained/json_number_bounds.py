"""Bounded number literals in JSON-schema grammars (on by default; lifted by
``--constrained-json-unbounded-numbers``), as whitespace already is: a small model otherwise
writes ``"population": 1111111...`` until ``max_new_tokens``.

* Integers: the bounds a schema leaves open are filled in with the int64 range. A schema
  bound on one side gets the other as ``minimum``/``maximum`` (both libraries turn these
  into an exact range grammar). An integer with no bound at all keeps none under xgrammar:
  its shared ``basic_integer`` rule is replaced by one exact int64 rule, since xgrammar
  writes a range grammar of ~100 rules for every bounded integer (2,000 integer properties
  took 100 s to compile that way, 1 s this way). llguidance
  reads bounds as doubles and negates the lower one while building its regex, so -2**63
  fails there; its lowest bound is the next double up, -(2**63 - 1024).
* Numbers: at most 15 integer digits (|x| < 1e15: every such integer part is exact in a
  double), 10 fraction digits and a 3-digit exponent (a double's decimal exponent lies in
  -324..308). xgrammar: its ``basic_number`` rule is replaced in the EBNF it generates from
  the schema (schema bounds would drop exponents: its range grammar has none). llguidance
  has no such rule to edit: ``minimum``/``maximum`` plus ``multipleOf: 1e-10`` (it reaches
  1e-10 exactly; 1e-11 fails its float-to-decimal step); it cannot keep an exponent next
  to bounds, so ``1e10`` must be written out there.

A bound the schema sets is kept as it is; only an open side is filled (a missing fraction
bound counts as open for llguidance), and never so that the range becomes empty. Values
fixed by ``enum``/``const`` need none.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LLGUIDANCE_INT_MIN = -(2**63 - 1024)
NUMBER_INT_DIGITS, FRACTION_DIGITS, EXPONENT_DIGITS = 15, 10, 3
NUMBER_MAX = 10**NUMBER_INT_DIGITS - 1

# Values under these keys are data, not schemas; maps from names to schemas are walked
# value by value (a property may be called "enum" or "minimum").
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})
_NAMED_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                                "dependentSchemas"})


@dataclass(frozen=True)
class NumberBounds:
    """How one library gets its numbers bounded by a schema rewrite."""

    int_min: int
    int_max: int
    bound_free_numbers: bool  # also numbers without any bound (False: the grammar does it)
    bound_free_integers: bool  # also integers without any bound (False: the grammar does it)
    fraction_step: Optional[float]  # multipleOf added to numbers that have none
    keep_multiple_of: bool  # leave integers with multipleOf alone (xgrammar drops it in big ranges)


XGRAMMAR_BOUNDS = NumberBounds(INT64_MIN, INT64_MAX, bound_free_numbers=False, bound_free_integers=False,
                               fraction_step=None, keep_multiple_of=True)
LLGUIDANCE_BOUNDS = NumberBounds(LLGUIDANCE_INT_MIN, INT64_MAX, bound_free_numbers=True, bound_free_integers=True,
                                 fraction_step=10.0**-FRACTION_DIGITS, keep_multiple_of=False)


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bound(node: dict, inclusive: str, exclusive: str, pick) -> Optional[float]:
    """The schema's own lower (pick=max) or upper (pick=min) bound, or None."""
    values = [node[k] for k in (inclusive, exclusive) if _num(node.get(k))]
    return pick(values) if values else None


def _bound_node(node: dict, bounds: NumberBounds) -> dict:
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "enum" in node or "const" in node or not ({"integer", "number"} & set(types)):
        return node
    is_int = "number" not in types
    if is_int and bounds.keep_multiple_of and "multipleOf" in node:
        return node
    lo, hi = _bound(node, "minimum", "exclusiveMinimum", max), _bound(node, "maximum", "exclusiveMaximum", min)
    if lo is None and hi is None and not (bounds.bound_free_integers if is_int else bounds.bound_free_numbers):
        return node
    lo_limit, hi_limit = (bounds.int_min, bounds.int_max) if is_int else (-NUMBER_MAX, NUMBER_MAX)
    out = dict(node)
    if lo is None and (hi is None or hi >= lo_limit):
        out["minimum"] = lo_limit
    if hi is None and (lo is None or lo <= hi_limit):
        out["maximum"] = hi_limit
    if not is_int and bounds.fraction_step is not None and "multipleOf" not in node:
        out["multipleOf"] = bounds.fraction_step
    return out


def bound_numbers(schema: Any, bounds: NumberBounds) -> Any:
    """A copy of ``schema`` whose integer/number subschemas carry the default bounds."""
    if isinstance(schema, list):
        return [bound_numbers(s, bounds) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _NAMED_SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bound_numbers(s, bounds) for name, s in value.items()}
        else:
            out[key] = bound_numbers(value, bounds)
    return _bound_node(out, bounds)


def _at_most(limit: str) -> list[str]:
    """EBNF alternatives for the decimals of ``len(limit)`` digits (no leading zero) <= limit."""
    alts, prefix = [], ""
    for i, digit in enumerate(limit):
        low, rest = (1 if i == 0 else 0), len(limit) - i - 1
        if int(digit) > low:
            tail = f" [0-9]{{{rest}}}" if rest else ""
            alts.append(f"{prefix}[{low}-{int(digit) - 1}]{tail}")
        prefix += f'"{digit}" '
    return alts + [prefix.strip()]


def _int64_rule() -> str:
    """``basic_integer`` for exactly the int64 range: up to 18 digits freely, 19 up to the
    limit on each side."""
    short = f'[1-9] [0-9]{{0,{len(str(INT64_MAX)) - 2}}}'
    positive = " | ".join(f"({a})" for a in [short, *_at_most(str(INT64_MAX))])
    negative = " | ".join(f"({a})" for a in [short, *_at_most(str(-INT64_MIN))])
    return f'basic_integer ::= ("0" | {positive} | "-" ({negative}))'


# xgrammar's JSON grammar has one rule for every unbounded number (typed or inside any
# value): a line ``basic_number ::= ...`` in the EBNF that Grammar.from_json_schema prints;
# ``basic_integer`` is the same for integers with no bound.
_NUMBER_RULE = re.compile(r"^basic_number ::= .*$", re.M)
_INTEGER_RULE = re.compile(r"^basic_integer ::= .*$", re.M)
BOUNDED_NUMBER_RULE = (
    f'basic_number ::= "-"? ("0" | [1-9] [0-9]{{0,{NUMBER_INT_DIGITS - 1}}}) '
    f'("." [0-9]{{1,{FRACTION_DIGITS}}})? ([eE] [+\\-]? [0-9]{{1,{EXPONENT_DIGITS}}})?')
BOUNDED_INTEGER_RULE = _int64_rule()


def bound_number_rule(ebnf: str) -> str:
    """xgrammar's JSON-schema EBNF with its ``basic_number`` and ``basic_integer`` rules bounded."""
    bounded, count = _NUMBER_RULE.subn(lambda _: BOUNDED_NUMBER_RULE, ebnf)
    bounded, int_count = _INTEGER_RULE.subn(lambda _: BOUNDED_INTEGER_RULE, bounded)
    if count != 1 or int_count > 1:
        raise RuntimeError(f"xgrammar's JSON grammar has {count} basic_number and {int_count} "
                           "basic_integer rules (expected 1 and at most 1): this xgrammar version "
                           "cannot bound numbers; start the server with "
                           "--constrained-json-unbounded-numbers")
    return bounded
