"""``oneOf`` with overlapping branches through the default backend (auto): the offline
rewrite (constrained/json_one_of.py), auto's routing, and the embedded model generating
documents that the real ``jsonschema`` validator accepts."""
from __future__ import annotations

import json

import jsonschema
import pytest

from constrained.auto_backend import AutoGrammarBackend
from constrained.base_grammar_backend import InvalidGrammarObject
from constrained.grammar_config import GrammarBackendConfig
from constrained.json_one_of import exclusive_one_of
from constrained.llguidance_backend import close_objects
from test_grammar_backend import accepts

VOCAB, EOS = 49152, 2
# A point {x} is also a labelled point {x, label?}: under anyOf {"x": 1} is fine, under
# oneOf it matches both branches and is invalid; only documents with "label" are valid.
# Closed explicitly, so jsonschema reads it as the backends do (they close objects).
POINTS = {
    "type": "object",
    "additionalProperties": {"oneOf": [{"$ref": "#/$defs/point"}, {"$ref": "#/$defs/labelled"}]},
    "$defs": {
        "point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                  "additionalProperties": False},
        "labelled": {"type": "object", "properties": {"x": {"type": "integer"},
                                                      "label": {"type": "string", "maxLength": 12}},
                     "required": ["x"], "additionalProperties": False},
    },
}


def test_overlapping_closed_branches_are_narrowed_to_disjoint_ones():
    rewritten = exclusive_one_of(close_objects(POINTS))
    (only,) = rewritten["additionalProperties"]["anyOf"]  # "point" lies inside "labelled": dropped
    assert only["required"] == ["x", "label"] and "oneOf" not in rewritten["additionalProperties"]
    for doc, ok in [({"a": {"x": 1, "label": "p"}}, True), ({"a": {"x": 1}}, False)]:
        assert jsonschema.Draft202012Validator(rewritten).is_valid(doc) is ok
        assert jsonschema.Draft202012Validator(POINTS).is_valid(doc) is ok
    same = {"oneOf": [{"$ref": "#/$defs/p"}, {"$ref": "#/$defs/p"}],
            "$defs": {"p": {"type": "object", "properties": {"x": {}}, "additionalProperties": False}}}
    assert exclusive_one_of(same) is None  # identical branches: nothing valid to keep
    assert exclusive_one_of({"oneOf": [{"type": "number"}, {"type": "integer"}]}) is None
    open_branches = {"oneOf": [{"type": "object"}, {"type": "object", "properties": {"a": {}}}]}
    assert exclusive_one_of(open_branches) is None  # not closed: key sets decide nothing


def test_auto_routes_one_of_to_llguidance_exactly_or_to_an_approximation(smollm2_tokenizer):
    auto = AutoGrammarBackend.from_tokenizer(smollm2_tokenizer, GrammarBackendConfig(VOCAB, (EOS,)))
    points = auto.init_value(("json_schema", json.dumps(POINTS)))
    assert points.stats.dispatch_type == "llguidance" and points.stats.gaps == (), points.stats
    assert accepts(points.copy(), smollm2_tokenizer, '{"a": {"x": 1, "label": "p"}}')
    assert not accepts(points.copy(), smollm2_tokenizer, '{"a": {"x": 1}}')
    # Neither library enforces this oneOf (an integer is also a number): both drop only it,
    # and on a tie llguidance's lenient reading (oneOf as anyOf) is served, and says so.
    numbers = auto.init_value(("json_schema", json.dumps({"oneOf": [{"type": "number"}, {"type": "integer"}]})))
    assert not isinstance(numbers, InvalidGrammarObject)
    assert numbers.stats.dispatch_type.startswith("llguidance (approximate: llguidance refused it: oneOf")
    assert numbers.stats.gaps == ("oneOf at #",)
    auto.shutdown()


@pytest.mark.timeout(600)
def test_embedded_model_writes_valid_one_of_documents(smollm2_dir, smollm2_tokenizer):
    from srt import Engine

    prompts = ["Describe two points on a map as JSON.", "Return some points as JSON.",
               "Name one point with its x coordinate and a label, as JSON."]  # ones that end in 160 tokens
    texts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in prompts]
    params = {"temperature": 0, "max_new_tokens": 160, "json_schema": POINTS}
    with Engine(model_path=smollm2_dir, max_total_tokens=2048, dtype="float32", random_seed=0) as engine:
        assert engine.server_args.grammar_backend == "auto"  # the default
        outs = engine.generate(texts, params)
    validator = jsonschema.Draft202012Validator(POINTS)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        doc = json.loads(out["text"])
        assert validator.is_valid(doc), (out["text"], [e.message for e in validator.iter_errors(doc)])
