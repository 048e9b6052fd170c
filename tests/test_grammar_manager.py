"""The grammar queue inside the real scheduler (the suite's tiny model, CPU): compiles that are slow,
shared, failing, timed out or aborted, plus the cross-rank agreement over real gloo."""
from __future__ import annotations

import json
import multiprocessing as mp
import threading

import pytest

from constrained.base_grammar_backend import BaseGrammarBackend
from constrained.registry import GRAMMAR_BACKEND_REGISTRY, register_grammar_backend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from distributed.grammar_agreement import agree_on_grammar_status
from distributed.parallel_state import SINGLE_RANK, TPGroup
from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import AbortReq, TokenizedGenerateReq
from test_scheduler import make_scheduler, run_until_done

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


class GatedBackend(BaseGrammarBackend):
    """A registered test backend: xgrammar, but each compile waits for ``gate``."""

    name = "gated"

    def __init__(self, inner: BaseGrammarBackend):
        super().__init__(num_threads=1)
        self.inner, self.gate, self.compiles = inner, threading.Event(), []

    def dispatch(self, key):
        self.compiles.append(key)
        self.gate.wait(60)
        return self.inner.dispatch(key)


@pytest.fixture(scope="module")
def sched(tiny_dir, smollm2_tokenizer):
    register_grammar_backend("gated", lambda tok, cfg: GatedBackend(XGrammarGrammarBackend.from_tokenizer(tok, cfg)))
    try:
        s = make_scheduler(tiny_dir, smollm2_tokenizer, max_total_tokens=2048, grammar_backend="gated")
    finally:
        GRAMMAR_BACKEND_REGISTRY.pop("gated")
    yield s
    s.grammar_manager.backend.gate.set()
    assert not s.has_work()
    s.grammar_manager.backend.shutdown()


def req(rid, tokenizer, **params):
    ids = tuple(tokenizer.encode("Answer in JSON:"))
    return TokenizedGenerateReq(rid, ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 24, **params}))


def test_slow_compile_times_out_with_the_documented_message(sched, smollm2_tokenizer, monkeypatch):
    monkeypatch.setenv("SGLANG_GRAMMAR_MAX_POLL_ITERATIONS", "5")
    monkeypatch.setenv("SGLANG_GRAMMAR_POLL_INTERVAL", "0.001")
    backend = sched.grammar_manager.backend
    backend.gate.clear()
    outs = run_until_done(sched, {0: [req("slow", smollm2_tokenizer, regex="(a|b)+x"),
                                      req("free", smollm2_tokenizer)]})
    slow = outs["slow"]["finish"]
    assert (slow.type, slow.status_code) == ("abort", 400)
    assert slow.message == ("Grammar preprocessing timed out: the regex grammar was not compiled "
                            "within 5 scheduler polls (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS).")
    assert outs["free"]["finish"].type in ("stop", "length")  # the other request ran
    backend.gate.set()


def test_shared_inflight_compile_then_cache_hit(sched, smollm2_tokenizer):
    backend = sched.grammar_manager.backend
    backend.gate.clear()
    backend.compiles.clear()
    schema = json.dumps(SCHEMA, separators=(",", ":"))  # already in the cache key's form
    first = [req(f"s{i}", smollm2_tokenizer, json_schema=schema) for i in range(3)]
    sched.process_input_requests(first)
    assert len(sched.grammar_manager.grammar_queue) == 3
    assert len({id(r.grammar_future) for r in sched.grammar_manager.grammar_queue}) == 1
    for _ in range(3):  # nothing is ready while the compile is held back
        sched.step()
    assert len(sched.grammar_manager.grammar_queue) == 3 and not sched.running
    backend.gate.set()
    outs = run_until_done(sched)
    assert backend.compiles == [("json_schema", schema)]  # one compile for three requests
    for i in range(3):
        assert outs[f"s{i}"]["finish"].type == "stop"
        assert json.loads(smollm2_tokenizer.decode(outs[f"s{i}"]["ids"], skip_special_tokens=True))["ok"] in (True, False)
    hit = run_until_done(sched, {0: [req("hit", smollm2_tokenizer, json_schema=schema)]})
    assert backend.compiles == [("json_schema", schema)]  # served from the cache
    assert hit["hit"]["ids"] == outs["s0"]["ids"]


def test_compile_failure_is_cached_and_reported(sched, smollm2_tokenizer):
    backend = sched.grammar_manager.backend
    backend.gate.set()
    backend.compiles.clear()
    bad = '{"type":"strin"}'
    outs = run_until_done(sched, {0: [req("bad1", smollm2_tokenizer, json_schema=bad)],
                                  3: [req("bad2", smollm2_tokenizer, json_schema=bad)]})
    for rid in ("bad1", "bad2"):
        f = outs[rid]["finish"]
        assert (f.type, f.status_code) == ("abort", 400)
        assert f.message == 'Failed to compile json_schema grammar: Unsupported type "strin"'
    assert backend.compiles == [("json_schema", bad)]  # the second one hit the negative cache


def test_abort_while_waiting_for_the_grammar(sched, smollm2_tokenizer):
    backend = sched.grammar_manager.backend
    backend.gate.clear()
    outs = run_until_done(sched, {0: [req("gone", smollm2_tokenizer, regex="[0-9]{4}")],
                                  2: [AbortReq("gone", "client went away", 499)]})
    f = outs["gone"]["finish"]
    assert (f.type, f.message) == ("abort", "client went away")
    assert not sched.grammar_manager.grammar_queue
    backend.gate.set()


def test_grammar_termination_ends_with_stop_and_eos_only_when_allowed(sched, smollm2_tokenizer):
    sched.grammar_manager.backend.gate.set()
    outs = run_until_done(sched, {0: [req("c", smollm2_tokenizer, choice=["alpha", "beta"]),
                                      req("n", smollm2_tokenizer, regex="[0-9]{3}", ignore_eos=True)]})
    text = smollm2_tokenizer.decode(outs["c"]["ids"], skip_special_tokens=True)
    assert text in ("alpha", "beta") and outs["c"]["finish"].type == "stop"
    digits = smollm2_tokenizer.decode(outs["n"]["ids"], skip_special_tokens=True)
    assert len(digits) == 3 and digits.isdigit() and outs["n"]["finish"].type == "stop"


# ---- agreement ---------------------------------------------------------------------------
def test_agreement_at_group_size_one_is_local():
    assert agree_on_grammar_status({0, 1, 2}, {1: "bad"}, SINGLE_RANK) == ({0, 2}, {1: "bad"})


def _agree_worker(rank, port, ready, failed, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=30))
    try:
        out.put((rank, agree_on_grammar_status(ready, failed, TPGroup(rank, 2, None, dist.group.WORLD))))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_agreement_over_gloo_takes_intersection_and_union():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    inputs = [({0, 1, 3}, {2: "rank0: bad"}), ({0, 2, 3}, {1: "rank1: timeout", 2: "rank1: bad"})]
    procs = [ctx.Process(target=_agree_worker, args=(r, port, *inputs[r], out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    expected = ({0, 3}, {1: "rank1: timeout", 2: "rank0: bad"})
    assert results[0] == results[1] == expected
