"""Grammar counters for --enable-metrics (constrained/grammar_metrics.py), counted by the
real backend base class, ``auto`` and the GrammarManager, with fake compilers (no model)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from constrained import grammar_manager as gm_module
from constrained.auto_backend import AutoGrammarBackend
from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from constrained.grammar_config import GrammarBackendConfig, JsonOptions
from constrained.grammar_manager import GrammarManager, GrammarPolling
from constrained.grammar_metrics import COMPILE_BUCKETS, Buckets, GrammarMetrics, fallback_label
from distributed.parallel_state import TPGroup


class Grammar(BaseGrammarObject):
    def is_terminated(self) -> bool:
        return False

    def copy(self) -> "Grammar":
        return Grammar()


class Regexes(BaseGrammarBackend):
    """Compiles any regex except "bad" (a compile failure)."""

    name = "fake"

    def dispatch_regex(self, spec: str) -> BaseGrammarObject:
        if spec == "bad":
            raise ValueError("no such regex")
        return Grammar()


def _req(rid: str, key):
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(constraint=key, grammar_key=key, thinking_budget=None), require_reasoning=False,
                           grammar=None, finished_reason=None)


def _manager(backend, tp=TPGroup(), polls=10000):
    def abort(req, message):
        req.finished_reason = message
    return GrammarManager(backend, tp, abort, polling=lambda: GrammarPolling(0.05, polls))


def _drain(manager):
    ready, failed = [], []
    for _ in range(200):
        r, f = manager.get_ready_grammar_requests(idle=True)
        ready += r
        failed += f
        if not manager.grammar_queue:
            return ready, failed
    raise AssertionError("grammar queue did not drain")


def test_buckets_use_le_semantics_and_keep_the_sum():
    b = Buckets((0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 3.0):
        b.observe(v)
    assert b.freeze() == ((0.1, 1.0), (1, 2, 1), 4.6)


def test_backend_and_manager_count_hits_misses_compiles_and_failures():
    backend = Regexes()
    manager = _manager(backend)
    assert manager.metrics is backend.metrics
    reqs = [_req("a", ("regex", "x+")), _req("b", ("regex", "x+")), _req("c", ("regex", "bad"))]
    for r in reqs:
        assert manager.process_req_with_grammar(r)  # all misses: a and b share one compile
    ready, failed = _drain(manager)
    assert [r.rid for r in ready] == ["a", "b"] and [r.rid for r in failed] == ["c"]
    hit = _req("d", ("regex", "x+"))
    assert not manager.process_req_with_grammar(hit) and hit.grammar is not None
    snap = backend.metrics.snapshot()
    assert (snap.cache_hits, snap.cache_misses, snap.aborted, snap.timeouts) == (1, 3, 1, 0)
    bounds, counts, total = snap.compile_seconds[("fake", "regex")]
    assert bounds == COMPILE_BUCKETS and sum(counts) == 2 and total >= 0  # one compile per key
    assert snap.compile_failures == {("fake", "regex"): 1}
    backend.shutdown()


def test_timeouts_are_counted_once_per_request(monkeypatch):
    backend = Regexes()
    monkeypatch.setattr(backend, "dispatch_regex", lambda spec: time.sleep(0.5) or Grammar())
    manager = _manager(backend, polls=2)
    r = _req("slow", ("regex", "y"))
    manager.process_req_with_grammar(r)
    _, failed = _drain(manager)
    assert failed == [r] and "timed out" in r.finished_reason
    snap = backend.metrics.snapshot()
    assert (snap.timeouts, snap.aborted) == (1, 1)
    backend.shutdown()


def test_agreement_time_is_observed_only_across_ranks(monkeypatch):
    backend = Regexes()
    monkeypatch.setattr(gm_module, "agree_on_grammar_status", lambda ready, failed, tp, queue_len, word=None: (ready, failed))
    for tp, expected in ((TPGroup(), 0), (TPGroup(0, 2), 1)):
        manager = _manager(backend, tp)
        manager.process_req_with_grammar(_req(f"r{tp.size}", ("regex", f"z{tp.size}")))
        _drain(manager)
        assert sum(backend.metrics.snapshot().agreement_seconds[1]) == expected
    backend.shutdown()


class Engine:
    """A stand-in for xgrammar or llguidance inside ``auto``: refuses specs containing
    any of ``refuses``."""

    def __init__(self, *refuses: str):
        self.refuses = refuses

    def dispatch(self, key):
        if any(word in key[1] for word in self.refuses):
            raise ValueError("unsupported")
        return Grammar()

    def compile_json_schema(self, spec, strict):  # an exact grammar, or refused
        return self.dispatch(("json_schema", spec))

    def dispatch_json_schema(self, spec):
        return self.dispatch(("json_schema", spec))


@pytest.mark.parametrize("xgr,llg,schema,label,outcome", [
    ((), ("minLength",), '{"type": "string", "minLength": 2}', "llguidance_refused", "xgrammar"),
    ((), ("not",), '{"not": {"type": "string"}}', "llguidance_refused", "xgrammar_approximation"),
    (("string",), ("string",), '{"type": "string"}', "llguidance_refused", "failed"),
])
def test_auto_counts_fallbacks_by_bounded_reason_and_outcome(xgr, llg, schema, label, outcome):
    auto = AutoGrammarBackend(Engine(*xgr), Engine(*llg), GrammarBackendConfig(100, (0,), JsonOptions()))
    auto.init_value(("json_schema", schema))
    auto.init_value(("json_schema", '{"type": "integer"}'))  # plain llguidance: no fallback
    assert auto.metrics.snapshot().auto_fallbacks == {(label, outcome): 1}
    BaseGrammarBackend.shutdown(auto)


def test_fallback_labels_never_carry_user_text():
    assert fallback_label("xgrammar rejected it: bad thing at 'user text'") == "xgrammar_rejected"
    assert fallback_label("uses --constrained-json-whitespace-pattern") == "whitespace_pattern"
    assert fallback_label("uses not") == "uses_not"


def test_snapshot_is_consistent_plain_data():
    m = GrammarMetrics()
    m.observe_compile("llguidance (fallback: uses oneOf)", "json_schema", 0.003, failed=False)
    m.count("cache_hits", 2)
    snap = m.snapshot()
    assert list(snap.compile_seconds) == [("llguidance", "json_schema")] and snap.cache_hits == 2
