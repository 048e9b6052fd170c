"""Default number bounds in JSON-schema grammars (constrained/json_number_bounds.py), on the
real xgrammar and llguidance backends with SmolLM2's tokenizer: ordinary values still pass,
over-long literals are refused, a schema's own bounds are kept, and the flag lifts it all."""
from __future__ import annotations

import json

import pytest

import random

import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from constrained.bitmask_ops import allocate_token_bitmask, unpack_bitmask
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.json_number_bounds import (INT64_MAX, INT64_MIN, LLGUIDANCE_BOUNDS, LLGUIDANCE_INT_MIN,
                                            XGRAMMAR_BOUNDS, bound_number_rule, bound_numbers)
from constrained.llguidance_backend import GuidanceBackend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from srt.server_args import ServerArgs

VOCAB, EOS = 49152, 2
BACKENDS = {"xgrammar": XGrammarGrammarBackend, "llguidance": GuidanceBackend}


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request, smollm2_tokenizer):
    config = GrammarBackendConfig(VOCAB, (EOS,), JsonOptions())
    b = BACKENDS[request.param].from_tokenizer(smollm2_tokenizer, config)
    yield b
    b.shutdown()


def complete(backend, tokenizer, schema: dict, text: str) -> bool:
    """Is ``text`` a whole document of ``schema``: every token allowed by the mask, then EOS?"""
    grammar = backend.dispatch(("json_schema", json.dumps(schema)))
    mask = allocate_token_bitmask(1, VOCAB)
    for tok in tokenizer.encode(text) + [EOS]:
        grammar.fill_vocab_mask(mask, 0)
        if not unpack_bitmask(mask, VOCAB)[0, tok]:
            return False
        grammar.accept_token(tok)
    return True


INTEGER_OK = ["0", "-1", "42", str(INT64_MAX), str(LLGUIDANCE_INT_MIN)]
INTEGER_TOO_LONG = [str(INT64_MAX + 1), str(INT64_MIN - 1), "1" * 20, "-" + "9" * 25]
NUMBER_OK = ["0", "-1", "3.14", "-0.5", "999999999999999", "0.1234567890", "10000000000", "-0.0025"]
NUMBER_TOO_LONG = ["1" * 16, "0." + "1" * 11, "-" + "2" * 30 + ".5"]


def test_ordinary_values_pass_and_runaway_literals_do_not(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    for text in INTEGER_OK:
        assert complete(backend, tok, {"type": "integer"}, text), (backend.name, text)
    for text in INTEGER_TOO_LONG:
        assert not complete(backend, tok, {"type": "integer"}, text), (backend.name, text)
    for text in NUMBER_OK:
        assert complete(backend, tok, {"type": "number"}, text), (backend.name, text)
    for text in NUMBER_TOO_LONG:
        assert not complete(backend, tok, {"type": "number"}, text), (backend.name, text)
    obj = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}
    assert complete(backend, tok, obj, '{"population": 8000000}')
    assert not complete(backend, tok, obj, '{"population": ' + "1" * 40 + "}")


def test_xgrammar_is_exact_at_int64_min_and_keeps_exponents(smollm2_tokenizer):
    b = XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, (EOS,)))
    tok = smollm2_tokenizer
    assert complete(b, tok, {"type": "integer"}, str(INT64_MIN))
    for text in ["1e10", "-2.5E-3", "6.02214076e+23", "1.5E308"]:
        assert complete(b, tok, {"type": "number"}, text), text
    assert not complete(b, tok, {"type": "number"}, "1e1234")
    # Values of any type (json_object, untyped properties) use the same bounded rule.
    assert complete(b, tok, {"type": "object"}, '{"a": [1.5, -2e3]}')
    assert not complete(b, tok, {"type": "object"}, '{"a": ' + "7" * 30 + "}")
    b.shutdown()


def test_llguidance_lower_limit_is_the_next_double_above_int64_min(smollm2_tokenizer):
    # llguidance reads bounds as doubles and negates the lower one: -2**63 fails to compile.
    b = GuidanceBackend.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, (EOS,)))
    assert not complete(b, smollm2_tokenizer, {"type": "integer"}, str(LLGUIDANCE_INT_MIN - 1))
    assert not complete(b, smollm2_tokenizer, {"type": "number"}, "1e10")  # no exponent next to bounds
    b.shutdown()


def test_bounds_a_schema_sets_are_kept(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert not complete(backend, tok, {"type": "integer", "minimum": 5}, "4")
    assert complete(backend, tok, {"type": "integer", "minimum": 5}, str(INT64_MAX))
    assert not complete(backend, tok, {"type": "integer", "minimum": 5}, "9" * 20)  # open side filled
    assert complete(backend, tok, {"type": "integer", "exclusiveMaximum": 0}, "-7")
    assert not complete(backend, tok, {"type": "integer", "exclusiveMaximum": 0}, "0")
    assert complete(backend, tok, {"type": "number", "minimum": 0, "maximum": 1}, "0.25")
    assert not complete(backend, tok, {"type": "number", "minimum": 0, "maximum": 1}, "2")
    nullable = {"type": ["integer", "null"]}
    assert complete(backend, tok, nullable, "null") and complete(backend, tok, nullable, "12")
    assert not complete(backend, tok, nullable, "1" * 25)
    assert complete(backend, tok, {"const": 1234567890123456}, "1234567890123456")  # data, not bounded


def test_the_flag_lifts_the_bounds(smollm2_tokenizer):
    args = ServerArgs(constrained_json_unbounded_numbers=True)
    config = GrammarBackendConfig.from_server_args(args, VOCAB, (EOS,))
    assert config.json.unbounded_numbers and not GrammarBackendConfig(VOCAB, (EOS,)).json.unbounded_numbers
    for cls in BACKENDS.values():
        b = cls.from_tokenizer(smollm2_tokenizer, config)
        assert complete(b, smollm2_tokenizer, {"type": "integer"}, "1" * 30), cls.name
        assert complete(b, smollm2_tokenizer, {"type": "number"}, "0." + "3" * 30), cls.name
        b.shutdown()


def test_rewrite_touches_only_open_numeric_schemas():
    schema = {"type": "object", "properties": {
        "minimum": {"type": "integer"},  # a property named like a keyword
        "n": {"type": "number", "maximum": 3},
        "m": {"type": "integer", "multipleOf": 5},
        "e": {"type": "integer", "enum": [1, 2]},
        "big": {"type": "integer", "minimum": 10**30},  # beyond int64: no empty range
    }, "default": {"type": "integer"}, "$defs": {"enum": {"type": "number"}}}
    x = bound_numbers(schema, XGRAMMAR_BOUNDS)
    p = x["properties"]
    assert p["minimum"] == {"type": "integer"}  # xgrammar's basic_integer rule bounds it
    assert p["n"] == {"type": "number", "maximum": 3, "minimum": -999999999999999}
    assert p["m"] == schema["properties"]["m"] and p["e"] == schema["properties"]["e"]
    assert p["big"] == schema["properties"]["big"]
    assert x["default"] == schema["default"] and x["$defs"]["enum"] == {"type": "number"}  # the EBNF bounds it
    g = bound_numbers(schema, LLGUIDANCE_BOUNDS)
    assert g["properties"]["m"]["minimum"] == LLGUIDANCE_INT_MIN  # llguidance keeps multipleOf in a range
    assert g["$defs"]["enum"] == {"type": "number", "minimum": -999999999999999,
                                  "maximum": 999999999999999, "multipleOf": 1e-10}
    assert g["properties"]["minimum"] == {"type": "integer", "minimum": LLGUIDANCE_INT_MIN, "maximum": INT64_MAX}
    assert bound_numbers({"type": "integer", "minimum": 5}, XGRAMMAR_BOUNDS)["maximum"] == INT64_MAX
    assert schema["properties"]["minimum"] == {"type": "integer"}  # the input is not mutated


def test_a_missing_number_rule_is_a_clear_error():
    with pytest.raises(RuntimeError, match="--constrained-json-unbounded-numbers"):
        bound_number_rule('root ::= "a"\n')


def test_xgrammar_integer_rule_is_exactly_int64():
    """The replacement ``basic_integer`` rule accepts a decimal iff it is an int64 (no
    leading zeros, no "-0"), checked at the limits and on random 1..20-digit strings."""
    ebnf = bound_number_rule(str(xgr.Grammar.from_json_schema(json.dumps({"type": "integer"}))))
    grammar = xgr.Grammar.from_ebnf(ebnf)
    near = [INT64_MAX + d for d in range(-11, 12)] + [INT64_MIN + d for d in range(-11, 12)]
    rng = random.Random(7)
    drawn = [rng.choice([1, -1]) * rng.randrange(10 ** rng.randrange(1, 21)) for _ in range(300)]
    for value in near + drawn + [0, 9, 10, 10**18 - 1, 10**18, -(10**18)]:
        assert _is_grammar_accept_string(grammar, str(value)) == (INT64_MIN <= value <= INT64_MAX), value
    for text in ["-0", "01", "-01", "", "-"]:
        assert not _is_grammar_accept_string(grammar, text), text


def test_many_free_integers_share_one_rule():
    """2,000 integer properties under xgrammar: one shared int64 rule, not a ~100-rule range
    grammar per property (that took minutes to compile on a 2-core machine)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
    bounded = bound_numbers(schema, XGRAMMAR_BOUNDS)
    assert all(p == {"type": "integer"} for p in bounded["properties"].values())
    ebnf = bound_number_rule(str(xgr.Grammar.from_json_schema(json.dumps(bounded))))
    assert ebnf.count("basic_integer ::=") == 1 and ebnf.count("\n") < 2 * 2000 + 100
