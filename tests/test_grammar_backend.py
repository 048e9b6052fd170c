"""Grammar backends without the model: the compile cache (hits, in-flight sharing, failures,
eviction), the registry, auto's per-request fallback and the JSON whitespace options,
all on the real xgrammar / llguidance libraries with SmolLM2's tokenizer."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from constrained.auto_backend import AutoGrammarBackend
from constrained.schema_coverage import xgrammar_gaps
from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, InvalidGrammarObject
from constrained.bitmask_ops import allocate_token_bitmask, unpack_bitmask
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.llguidance_backend import GuidanceBackend, ascii_shorthands, close_objects
from constrained.registry import GRAMMAR_BACKEND_REGISTRY, create_grammar_backend, register_grammar_backend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from srt.server_args import ServerArgs

VOCAB, EOS = 49152, (2,)
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    separators=(",", ":"))


def config(**json_opts) -> GrammarBackendConfig:
    return GrammarBackendConfig(VOCAB, EOS, JsonOptions(**json_opts))


@pytest.fixture(scope="module")
def xgr(smollm2_tokenizer):
    return XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, config())


@pytest.fixture(scope="module")
def llg(smollm2_tokenizer):
    return GuidanceBackend.from_tokenizer(smollm2_tokenizer, config())


def accepts(grammar: BaseGrammarObject, tokenizer, text: str) -> bool:
    """Feed ``text`` token by token, checking each token against the filled mask too."""
    mask = allocate_token_bitmask(1, VOCAB)
    for tok in tokenizer.encode(text):
        grammar.fill_vocab_mask(mask, 0)
        if not unpack_bitmask(mask, VOCAB)[0, tok]:
            return False
        grammar.accept_token(tok)
    return True


def rejects(grammar: BaseGrammarObject, tokenizer, text: str) -> bool:
    try:
        return not accepts(grammar, tokenizer, text)
    except ValueError:  # accept_token refused a token the mask allowed
        return True


class CountingBackend(BaseGrammarBackend):
    """Compiles only once ``gate`` is set, counting compiles per key."""

    name = "counting"

    def __init__(self, inner: BaseGrammarBackend):
        super().__init__(num_threads=2, cache_size=2)
        self.inner, self.gate, self.calls = inner, threading.Event(), {}

    def dispatch(self, key):
        self.calls[key] = self.calls.get(key, 0) + 1
        assert self.gate.wait(30)
        return self.inner.dispatch(key)


def test_cache_hit_copy_inflight_sharing_and_eviction(xgr, smollm2_tokenizer):
    b = CountingBackend(xgr)
    key = ("regex", "(yes|no)")
    f1, hit1 = b.get_cached_or_future_value(key)
    f2, hit2 = b.get_cached_or_future_value(key)
    assert not hit1 and not hit2 and f1 is f2  # one compile shared while in flight
    b.gate.set()
    value = f1.result(timeout=30)
    assert b.calls == {key: 1} and value.stats.compile_time > 0 and value.stats.dispatch_type == "counting"
    b.set_cache(key, value)  # the manager does this after agreement
    c1, hit = b.get_cached_or_future_value(key)
    c2, _ = b.get_cached_or_future_value(key)
    assert hit and c1 is not value and c1 is not c2 and c1.stats.cache_hit
    assert accepts(c1, smollm2_tokenizer, "yes") and accepts(c2, smollm2_tokenizer, "no")
    assert b.calls == {key: 1}
    for k in (("regex", "a"), ("regex", "b")):  # cache_size=2: the oldest entry goes
        b.set_cache(k, b.get_cached_or_future_value(k)[0].result(timeout=30))
    assert not b.get_cached_or_future_value(key)[1]
    b.shutdown()


def test_failures_become_invalid_objects_with_the_library_reason(xgr, llg):
    for backend in (xgr, llg):
        for key, reason in [(("json_schema", '{"type":"strin"}'), "strin"), (("regex", "a(b"), ""),
                            (("ebnf", 'root ::= "a" | b'), "b")]:
            value = backend.init_value(key)
            assert isinstance(value, InvalidGrammarObject), (backend.name, key)
            assert value.message.startswith(f"Failed to compile {key[0]} grammar: ")
            assert reason in value.message and "\n" not in value.message
            assert not value.message.startswith(f"Failed to compile {key[0]} grammar: [")  # no C++ prefix


def test_release_cancels_a_compile_nobody_waits_for(xgr):
    b = CountingBackend(xgr)
    b.executor.submit(b.gate.wait, 30)  # occupy both workers so the next compile queues
    b.executor.submit(b.gate.wait, 30)
    future, _ = b.get_cached_or_future_value(("regex", "x"))
    b.release(("regex", "x"), still_waiting=False)
    assert future.cancelled() and b.cache_info()["in_flight"] == 0
    b.gate.set()
    b.shutdown()


def test_every_kind_compiles_and_constrains_on_both_backends(xgr, llg, smollm2_tokenizer):
    tag = {"type": "structural_tag", "triggers": ["<f"],
           "structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {
               "a": {"type": "integer"}}, "required": ["a"]}, "end": "</f>"}]}
    cases = [("json_schema", SCHEMA, '{"a": 12}', '{"b": 1}'),
             ("regex", r"[0-9]{3}-[a-z]+", "123-abc", "12a"),
             ("ebnf", 'root ::= "(" num ")"\nnum ::= [0-9]+', "(42)", "42"),
             ("choice", json.dumps(["red", "green"]), "green", "blue"),
             ("structural_tag", json.dumps(tag), 'hi <f>{"a": 1}</f>', '<f>{"b": 1}</f>')]
    for backend in (xgr, llg):
        for kind, spec, good, bad in cases:
            value = backend.init_value((kind, spec))
            assert not isinstance(value, InvalidGrammarObject), (backend.name, kind, getattr(value, "message", ""))
            assert accepts(value.copy(), smollm2_tokenizer, good), (backend.name, kind)
            assert rejects(value.copy(), smollm2_tokenizer, bad)


def test_grammar_terminates_after_eos_and_mask_allows_only_eos(xgr, llg, smollm2_tokenizer):
    for backend in (xgr, llg):
        g = backend.init_value(("choice", '["yes"]')).copy()
        assert accepts(g, smollm2_tokenizer, "yes")
        mask = allocate_token_bitmask(1, VOCAB)
        g.fill_vocab_mask(mask, 0)
        assert unpack_bitmask(mask, VOCAB)[0].nonzero().flatten().tolist() == [2]
        if not g.is_terminated():  # xgrammar ends on EOS; llguidance as soon as only EOS fits
            g.accept_token(2)
        assert g.is_terminated()


def test_whitespace_is_bounded_by_default_and_compact_when_disabled(smollm2_tokenizer):
    for cls in (XGrammarGrammarBackend, GuidanceBackend):
        bounded = cls.from_tokenizer(smollm2_tokenizer, config(max_whitespace=2)).init_value(("json_schema", SCHEMA))
        assert accepts(bounded.copy(), smollm2_tokenizer, '{ "a": 1}')
        assert rejects(bounded.copy(), smollm2_tokenizer, '{' + " " * 8 + '"a": 1}')
        compact = cls.from_tokenizer(smollm2_tokenizer, config(disable_any_whitespace=True)).init_value(("json_schema", SCHEMA))
        assert accepts(compact.copy(), smollm2_tokenizer, '{"a":1}'), cls.name
        assert rejects(compact.copy(), smollm2_tokenizer, '{"a": 1}')


def test_llguidance_whitespace_pattern(smollm2_tokenizer):
    b = GuidanceBackend.from_tokenizer(smollm2_tokenizer, config(whitespace_pattern=r"[\n]?"))
    g = b.init_value(("json_schema", SCHEMA))
    assert accepts(g.copy(), smollm2_tokenizer, '{\n"a":\n1}')
    assert rejects(g.copy(), smollm2_tokenizer, '{ "a": 1}')
    with pytest.raises(ValueError, match="whitespace"):
        XGrammarGrammarBackend.from_tokenizer(smollm2_tokenizer, config(whitespace_pattern="[ ]?"))


def test_close_objects_matches_xgrammar_strictness():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "allOf": [{"properties": {"c": {}}}], "enum": [{"properties": 1}]}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0] and closed["enum"] == schema["enum"]
    assert "additionalProperties" not in close_objects({"type": "object"})
    pet = {"allOf": [{"$ref": "#/$defs/new"}, {"properties": {"id": {}}, "required": ["id"]}],
           "$defs": {"new": {"properties": {"name": {}}}, "other": {"properties": {"x": {}}}}}
    closed = close_objects(pet)  # a schema an allOf branch refers to stays open, others close
    assert "additionalProperties" not in closed["$defs"]["new"]
    assert closed["$defs"]["other"]["additionalProperties"] is False


def test_auto_falls_back_per_request_and_reports_why(smollm2_tokenizer):
    auto = AutoGrammarBackend.from_tokenizer(smollm2_tokenizer, config())
    plain = auto.init_value(("json_schema", SCHEMA))
    assert plain.stats.dispatch_type == "llguidance" and plain.stats.gaps == ()  # exact, first choice
    one_of = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}  # exclusive: as anyOf
    assert xgrammar_gaps(one_of) == []
    assert auto.init_value(("json_schema", json.dumps(one_of))).stats.gaps == ()
    # llguidance refuses propertyNames; xgrammar enforces it (next to no properties): exact there
    names = json.dumps({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                        "additionalProperties": {"type": "integer"}})
    v = auto.init_value(("json_schema", names))
    assert v.stats.dispatch_type.startswith("xgrammar (fallback: llguidance refused it: ") and v.stats.gaps == ()
    assert accepts(v.copy(), smollm2_tokenizer, '{"ab": 1}') and not accepts(v.copy(), smollm2_tokenizer, '{"A')
    all_of = json.dumps({"allOf": [{"type": "integer"}, {"minimum": 3}]})
    assert [str(g) for g in xgrammar_gaps(json.loads(all_of))] == ["allOf at #", "minimum at #/allOf/1"]
    v = auto.init_value(("json_schema", all_of))
    assert v.stats.dispatch_type == "llguidance" and v.stats.gaps == ()
    assert accepts(v.copy(), smollm2_tokenizer, "12") and not accepts(v.copy(), smollm2_tokenizer, "-1")
    lookahead = auto.init_value(("regex", "(?=a)a+"))  # xgrammar rejects lookaround syntax
    assert "xgrammar rejected it" in (lookahead.stats.dispatch_type + getattr(lookahead, "message", ""))
    both_bad = auto.init_value(("json_schema", '{"type":"strin"}'))
    assert isinstance(both_bad, InvalidGrammarObject)
    assert "xgrammar: " in both_bad.message and "llguidance: " in both_bad.message
    length_pattern = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    assert [g.keyword for g in xgrammar_gaps(length_pattern)] == ["maxLength"]
    assert xgrammar_gaps({"enum": [{"oneOf": 1}]}) == []  # data, not schema
    assert xgrammar_gaps({"type": "object", "properties": {"not": {"type": "integer"}}}) == []  # a name
    auto.shutdown()


def test_registry_builds_backends_by_name(smollm2_tokenizer):
    made = []

    def factory(tokenizer, cfg):
        made.append(cfg)
        return XGrammarGrammarBackend.from_tokenizer(tokenizer, cfg)

    register_grammar_backend("test-registered", factory)
    try:
        args = ServerArgs(grammar_backend="test-registered", grammar_cache_size=7)
        backend = create_grammar_backend(args, smollm2_tokenizer, VOCAB, EOS)
        assert isinstance(backend, XGrammarGrammarBackend) and made[0].cache_size == 7
        assert create_grammar_backend(ServerArgs(grammar_backend="none"), smollm2_tokenizer, VOCAB, EOS) is None
        with pytest.raises(ValueError, match="Unknown --grammar-backend 'nope'.*test-registered"):
            create_grammar_backend(ServerArgs(grammar_backend="nope"), smollm2_tokenizer, VOCAB, EOS)
        with pytest.raises(ValueError, match="reserved"):
            register_grammar_backend("none", factory)
    finally:
        GRAMMAR_BACKEND_REGISTRY.pop("test-registered")


def test_server_args_reject_whitespace_pattern_with_xgrammar():
    with pytest.raises(ValueError, match="llguidance or auto"):
        ServerArgs(grammar_backend="xgrammar", constrained_json_whitespace_pattern="[ ]?")
    assert ServerArgs().grammar_backend == "auto"  # the default takes the flag
    ServerArgs(constrained_json_whitespace_pattern="[ ]?")


def test_mask_fill_rows_are_independent(xgr, llg, smollm2_tokenizer):
    """One bitmask holds rows of different backends; each row is that grammar's mask."""
    a = xgr.init_value(("choice", '["yes"]')).copy()
    b = llg.init_value(("choice", '["no"]')).copy()
    mask = allocate_token_bitmask(3, VOCAB)
    a.fill_vocab_mask(mask, 0)
    b.fill_vocab_mask(mask, 2)
    allowed = unpack_bitmask(mask, VOCAB)
    assert allowed[1].all()
    yes, no = smollm2_tokenizer.encode("yes")[0], smollm2_tokenizer.encode("no")[0]
    assert allowed[0, yes] and not allowed[0, no] and allowed[2, no] and not allowed[2, yes]
    assert torch.equal(mask[1], torch.full_like(mask[1], -1))


def test_llguidance_regex_shorthands_are_ascii_like_xgrammar(xgr, llg, smollm2_tokenizer):
    assert ascii_shorthands(r"\d{2}[\d.]\\d\w\s\D") == r"(?-u:\d){2}[0-9.]\\d(?-u:\w)(?-u:\s)\D"
    for backend in (xgr, llg):
        g = backend.init_value(("regex", r"\d+"))
        assert accepts(g.copy(), smollm2_tokenizer, "12")
        assert rejects(g.copy(), smollm2_tokenizer, "\U0001FBF8"), backend.name  # SEGMENTED DIGIT EIGHT


def test_guidance_one_row_fills_in_line_like_the_pool(llg, smollm2_tokenizer, monkeypatch):
    """llguidance fills a single row on the caller's thread and more rows on its pool: the
    masks are the same at every step of a document, and other rows stay all allowed."""
    import llguidance.numpy

    pool_calls = []
    par = llguidance.numpy.fill_next_token_bitmask_par
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par",
                        lambda *a: pool_calls.append(len(a[1])) or par(*a))
    spec = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                       "required": ["name", "n"]})
    alone, first, second = (llg.init_value(("json_schema", spec)).copy() for _ in range(3))
    filler = alone.mask_filler
    for tok in smollm2_tokenizer.encode('{"name": "Ada Lovelace", "n": 1815}'):
        one, three = allocate_token_bitmask(1, VOCAB), allocate_token_bitmask(3, VOCAB)
        filler.fill([alone], one, [0])
        filler.fill([first, second], three, [0, 2])
        assert torch.equal(one[0], three[0]) and torch.equal(one[0], three[2])
        assert torch.equal(three[1], torch.full_like(three[1], -1))
        assert unpack_bitmask(one, VOCAB)[0, tok], tok
        for g in (alone, first, second):
            g.accept_token(tok)
    assert pool_calls and set(pool_calls) == {2}  # the one-row fills never went to the pool
