"""Serving a hybrid Gated DeltaNet model (the tiny model's Qwen3.5 twin: random weights,
SmolLM2's tokenizer; layers L L L F) through the real scheduler, fp32, eager.

A reference scheduler gives each prompt's greedy answer alone; every path must give the very
same tokens: a batch (the one-row requests' batched recurrent step), chunked prefill (the state
carried across chunks), mixed chunks, retraction and resume, ``n`` = 4, and JSON schemas with
grammar fast-forward (several decode rows of one request run in order through the recurrence)
on xgrammar and llguidance. After each run the request rows, and with them the state slots,
are all free again (check_idle_integrity). The combinations not built yet are refused.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from sampling.sampling_params import SamplingParams
from srt.frontend.samples import split_samples
from srt.transport.io_struct import TokenizedGenerateReq
from srt.model_executor.hybrid_limits import hybrid_serving_args
from srt.model_executor.model_config import ModelConfig
from srt.server_args import ServerArgs
from test_scheduler import make_scheduler, req, run_until_done

GREEDY = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "city", "age"], "additionalProperties": False}


def _prompts(tok) -> list[str]:
    long = " ".join(f"Item {i} of the list is stored on shelf {i % 7}." for i in range(12))
    assert len(tok(long)["input_ids"]) > 100  # over the 64-token chunk and several 32-token prefill chunks
    return ["The capital of France is", "def fibonacci(n):", long, "One, two, three, four,", "Hi"]


@pytest.fixture(scope="module")
def alone(tiny_hybrid_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer
    # The reference: no radix cache, every prompt computed from its first token.
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=2048, max_running_requests=8,
                       disable_radix_cache=True)
    assert s.kv.tree is None and s.runner.state_pool is not None
    answers = []
    for i, p in enumerate(_prompts(tok)):
        outs = run_until_done(s, {0: [req(tok, f"a{i}", p, **GREEDY)]})
        answers.append(outs[f"a{i}"]["ids"])
    assert len({tuple(a) for a in answers}) == len(answers)  # the prompts do not collapse to one answer
    return answers


def _batch(s, tok, prefix="b", **params):
    reqs = [req(tok, f"{prefix}{i}", p, **{**GREEDY, **params}) for i, p in enumerate(_prompts(tok))]
    outs = run_until_done(s, {0: reqs[:3], 2: reqs[3:]})  # the last two arrive while others decode
    return [outs[f"{prefix}{i}"]["ids"] for i in range(len(reqs))]


def test_a_batch_gives_what_each_prompt_gives_alone(tiny_hybrid_dir, smollm2_tokenizer, alone):
    s = make_scheduler(tiny_hybrid_dir, smollm2_tokenizer, max_total_tokens=2048, max_running_requests=8)
    assert _batch(s, smollm2_tokenizer) == alone


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_prefill_and_mixed_chunks_carry_the_state(tiny_hybrid_dir, smollm2_tokenizer, alone, mixed):
    s = make_scheduler(tiny_hybrid_dir, smollm2_tokenizer, max_total_tokens=2048, max_running_requests=8,
                       chunked_prefill_size=32, enable_mixed_chunk=mixed)
    assert _batch(s, smollm2_tokenizer) == alone


def test_retraction_frees_the_slot_and_the_request_resumes_exactly(
        tiny_hybrid_dir, smollm2_tokenizer, alone, monkeypatch):
    monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "1")  # admit optimistically
    tok = smollm2_tokenizer
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=200, max_running_requests=8)
    assert _batch(s, tok, "r") == alone
    assert s.num_retractions > 0


def test_n4_equals_four_requests(tiny_hybrid_dir, smollm2_tokenizer, alone):
    """n = 4 as the frontend sends it (four samples of one prefix group, samples.py): one
    prefill, the others start from its state checkpoint; greedy equal to the prompt alone;
    seeded samples reproducible and distinct."""
    tok = smollm2_tokenizer
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=2048, max_running_requests=8)
    prompt = _prompts(tok)[2]
    outs = run_until_done(s, {0: split_samples(req(tok, "n", prompt, n=4, **GREEDY))})
    assert [outs[f"n-{i}"]["ids"] for i in range(4)] == [alone[2]] * 4
    # One prefill: the other samples fork its state one token before the prompt's end.
    prompt_len = outs["n-0"]["prompt_tokens"]
    assert sorted(outs[f"n-{i}"]["cached_tokens"] for i in range(4)) == [0] + [prompt_len - 1] * 3
    seeded = dict(temperature=0.9, max_new_tokens=12, ignore_eos=True, seed=5)
    one = run_until_done(s, {0: split_samples(req(tok, "s", prompt, n=4, **seeded))})
    again = run_until_done(s, {0: split_samples(req(tok, "s", prompt, n=4, **seeded))})
    first = [one[f"s-{i}"]["ids"] for i in range(4)]
    assert first == [again[f"s-{i}"]["ids"] for i in range(4)] and len({tuple(f) for f in first}) > 1


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_json_schema_with_fast_forward_is_valid_and_batch_independent(
        tiny_hybrid_dir, smollm2_tokenizer, backend):
    """Valid documents with fast-forward on and off; with it on, a request's forced tokens
    ride as extra rows of one decode step, and its output alone equals its output in a batch
    beside another. (Greedy output with and without fast-forward differs on random weights,
    the dense tiny model's too: the forced tokens are the canonical tokenization, which a
    random model would not pick; that the rows equal separate steps is checked on the model,
    test_hybrid_models.py.)"""
    tok = smollm2_tokenizer
    params = dict(temperature=0, max_new_tokens=96, json_schema=json.dumps(SCHEMA))
    prompts = ["A person as JSON:", "JSON please:"]
    for ff_off in (False, True):
        s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=2048, max_running_requests=8,
                           grammar_backend=backend, disable_grammar_fast_forward=ff_off)
        outs = run_until_done(s, {0: [req(tok, f"j{i}", p, **params) for i, p in enumerate(prompts)]})
        alone = run_until_done(s, {0: [req(tok, "solo", prompts[0], **params)]})
        assert alone["solo"]["ids"] == outs["j0"]["ids"]
        assert (s.step_stats.fast_forward_tokens > 0) != ff_off
        for i in range(2):
            assert outs[f"j{i}"]["finish"].type == "stop", outs[f"j{i}"]["finish"]
            jsonschema.validate(json.loads(tok.decode(outs[f"j{i}"]["ids"], skip_special_tokens=True)), SCHEMA)
        s.grammar_manager.backend.shutdown()


@pytest.mark.parametrize("kw, what", [
    ({"torchao_config": "int8wo"}, "--torchao-config int8wo"),
    ({"enable_torch_compile": True}, "--enable-torch-compile"),
])
def test_combinations_not_built_yet_are_refused(tiny_hybrid_dir, kw, what):
    args = ServerArgs(model_path=tiny_hybrid_dir, **kw)
    with pytest.raises(ValueError, match=f"hybrid Gated DeltaNet model: {what} is not built yet"):
        hybrid_serving_args(args, ModelConfig.from_path(tiny_hybrid_dir))


def test_what_is_switched_off_is_said(tiny_hybrid_dir, tiny_dir):
    served, notes = hybrid_serving_args(ServerArgs(model_path=tiny_hybrid_dir), ModelConfig.from_path(tiny_hybrid_dir))
    assert served.disable_prompt_logprob_cache and served.disable_torch_compile and not served.disable_radix_cache
    assert any("prompt-logprob cache off" in n for n in notes)
    dense = ServerArgs(model_path=tiny_dir)
    assert hybrid_serving_args(dense, ModelConfig.from_path(tiny_dir)) == (dense, ())


def test_engine_reports_the_state_pool_and_serves_n2(tiny_hybrid_dir):
    """Real processes: the state pool and what is switched off reach /get_server_info's
    scheduler info; n = 2 through the frontend's sample split."""
    from srt.entrypoints.engine import Engine

    with Engine(model_path=tiny_hybrid_dir, dtype="float32", max_total_tokens=1024,
                max_running_requests=4, random_seed=0) as engine:
        info = engine.scheduler_info
        assert info.linear_state_slots == 12 and info.linear_state_bytes_per_slot > 0  # 4 running + 8 checkpoints
        assert any("prompt-logprob cache off" in n for n in info.model_limits)
        outs = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8, "n": 2})
        assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]


def test_speculation_rolls_back_rejected_drafts_exactly(tiny_hybrid_dir, smollm2_tokenizer, alone):
    """NGRAM drafts on a hybrid: greedy tokens identical to decoding without speculation
    while drafts are accepted in part (the slot rolled back to the last kept row's state),
    with a JSON-schema request among them (fast-forward rows and drafts together). Each
    prompt is P + (P's answer) + P: the drafter proposes the old answer, and the random
    model follows it for a few tokens, then not (a forced partial acceptance). Four run at once
    and the fifth waits: an open batch, whose drafts the step's throughput plans (a closed
    one drafts only for its longest request, draft_plan.py)."""
    tok = smollm2_tokenizer
    prompts = [tuple(tok(p)["input_ids"]) for p in _prompts(tok)[:4]]
    looped = [p + tuple(a) + p for p, a in zip(prompts, alone)]
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    schema = dict(temperature=0, max_new_tokens=80, json_schema=json.dumps(SCHEMA))

    def run(spec):
        s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=4096, max_running_requests=4,
                           speculative_algorithm="NGRAM" if spec else None)
        reqs = [req(tok, "json", "A person as JSON:", **schema)]
        reqs += [TokenizedGenerateReq(f"p{i}", ids, greedy) for i, ids in enumerate(looped)]
        outs = run_until_done(s, {0: reqs})
        s.grammar_manager.backend.shutdown()
        return {rid: o["ids"] for rid, o in outs.items()}, s

    plain, _ = run(False)
    spec, s = run(True)
    assert spec == plain
    st = s.step_stats
    assert 0 < st.spec_accepted_tokens < st.spec_drafted_tokens and s.kv.state_pool.rollbacks > 0
    jsonschema.validate(json.loads(tok.decode(spec["json"], skip_special_tokens=True)), SCHEMA)


def test_radix_cache_hits_resume_from_state_checkpoints_exactly(tiny_hybrid_dir, smollm2_tokenizer, alone):
    """The same prompt again: a hit one token short of it (the checkpoint kept there); prompts
    sharing a long system prompt: the second one checkpoints the branch point, the later ones
    hit it. Every answer equals the no-cache reference; the tree's checkpoints are all
    accounted for when idle (run_until_done's check_idle_integrity)."""
    tok = smollm2_tokenizer
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=4096, max_running_requests=8)
    ref = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=4096, max_running_requests=8,
                         disable_radix_cache=True)
    prompts = _prompts(tok)
    first = run_until_done(s, {0: [req(tok, "x", prompts[2], **GREEDY)]})["x"]
    again = run_until_done(s, {0: [req(tok, "y", prompts[2], **GREEDY)]})["y"]
    assert first["ids"] == again["ids"] == alone[2]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] == first["prompt_tokens"] - 1
    system = " ".join(f"Rule {i}: answer in one short line about topic {i}." for i in range(10))
    questions = [f"{system} Question {q}?" for q in ("one", "two", "three", "four")]
    got = [run_until_done(s, {0: [req(tok, f"q{i}", q, **GREEDY)]})[f"q{i}"] for i, q in enumerate(questions)]
    want = [run_until_done(ref, {0: [req(tok, f"q{i}", q, **GREEDY)]})[f"q{i}"] for i, q in enumerate(questions)]
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    shared = len(tok(system)["input_ids"])
    assert got[0]["cached_tokens"] == got[1]["cached_tokens"] == 0  # no checkpoint at the branch yet
    assert all(g["cached_tokens"] >= shared - 2 for g in got[2:])  # the branch point's checkpoint
    assert s.kv.tree.digest() == s.kv.tree.digest()  # stable; the checkpoints are hashed with the tree
    assert s.kv.states.checkpoints.available() < s.kv.states.checkpoints.capacity


@pytest.mark.parametrize("pool", ["states", "kv"])
def test_checkpoint_and_kv_eviction_keep_answers_exact(tiny_hybrid_dir, smollm2_tokenizer, alone, pool,
                                                      monkeypatch):
    """Few checkpoint slots (states: their own LRU budget) or a small KV pool (kv: evicted
    KV takes its checkpoints with it; requests are retracted and resume from their own
    checkpoints): the answers stay the reference's, and nothing leaks."""
    tok = smollm2_tokenizer
    kw = dict(max_mamba_cache_size=6) if pool == "states" else dict(max_total_tokens=260)
    if pool == "kv":
        monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "1")  # admit optimistically
    s = make_scheduler(tiny_hybrid_dir, tok, max_running_requests=4, **{"max_total_tokens": 4096, **kw})
    for rnd in range(2):
        assert _batch(s, tok, f"e{rnd}-") == alone
    tree, ckpt = s.kv.tree, s.kv.states.checkpoints
    if pool == "states":
        assert ckpt.capacity == 2 and len(tree.state_nodes()) <= 2
    else:
        assert tree.evicted_tokens > 0
    assert len(tree.state_nodes()) + ckpt.available() == ckpt.capacity


@pytest.mark.timeout(400)
@pytest.mark.parametrize("parallel, ranks", [
    ({"tp_size": 2, "speculative_algorithm": "NGRAM"}, ("DP0_TP0", "DP0_TP1")),
    ({"pp_size": 2, "chunked_prefill_size": 32}, ("DP0_PP0_TP0", "DP0_PP1_TP0")),
])
def test_tp2_and_pp2_give_the_reference_tokens_with_identical_batch_logs(
        tiny_hybrid_dir, smollm2_tokenizer, alone, tmp_path, monkeypatch, parallel, ranks):
    """Real processes, gloo. TP=2 with NGRAM speculation: the GDN layers split by key-head
    groups (each rank its own share of every state), rejected drafts rolled back alike; PP=2: each stage owns its layers' states (stage 1 holds the
    attention layer and one GDN layer), micro-batches continuing each other's slots, chunks cut
    inside prompts. JSON schema and n = 2 among the requests; the ranks' batch logs (batches,
    radix digests with their checkpoints, agreements) are identical."""
    from srt.entrypoints.engine import Engine
    from test_grammar_agreement_ranks import _identical_batch_logs

    logs = tmp_path / "batches"
    monkeypatch.setenv("GRAMSYNC_BATCH_LOG_DIR", str(logs))
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=tiny_hybrid_dir, dtype="float32", max_total_tokens=2048, max_running_requests=8,
                random_seed=0, **parallel) as engine:
        prompts = _prompts(smollm2_tokenizer)
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == alone
        two = engine.generate(prompts[2], {**params, "n": 2})
        assert [o["output_ids"] for o in two] == [alone[2]] * 2
        doc = engine.generate("A person as JSON:", {"temperature": 0, "max_new_tokens": 80,
                                                    "json_schema": json.dumps(SCHEMA)})
        jsonschema.validate(json.loads(doc["text"]), SCHEMA)
    batches = _identical_batch_logs(logs, ranks=ranks)
    assert len(batches) > 3


def test_a_burst_sharing_a_system_prompt_checkpoints_where_it_parts(tiny_hybrid_dir, smollm2_tokenizer):
    """Three requests with one system prompt prefilled together (an empty cache, no hit for
    them): each checkpoints where it parts from the others, so the fourth hits the shared part."""
    tok = smollm2_tokenizer
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=4096, max_running_requests=8)
    ref = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=4096, max_running_requests=8,
                         disable_radix_cache=True)
    system = " ".join(f"Policy {i}: keep every reply under {i + 3} words." for i in range(8))
    qs = [req(tok, f"b{i}", f"{system} Now: {w}?", **GREEDY) for i, w in enumerate(("why", "how", "when", "who"))]
    burst = run_until_done(s, {0: qs[:3]})
    late = run_until_done(s, {0: qs[3:]})["b3"]
    want = run_until_done(ref, {0: qs})
    assert [burst[f"b{i}"]["ids"] for i in range(3)] + [late["ids"]] == [want[f"b{i}"]["ids"] for i in range(4)]
    assert all(burst[f"b{i}"]["cached_tokens"] == 0 for i in range(3))
    assert late["cached_tokens"] >= len(tok(system)["input_ids"]) - 2


def test_chunk_ends_are_checkpoints(tiny_hybrid_dir, smollm2_tokenizer):
    """Chunked prefill (32-token chunks, as while another request decodes) checkpoints each
    chunk's end: a later prompt that parts from a cached one at token 70 resumes from the
    chunk boundary at 64."""
    tok = smollm2_tokenizer
    kw = dict(max_total_tokens=4096, max_running_requests=4, chunked_prefill_size=32)
    s = make_scheduler(tiny_hybrid_dir, tok, **kw)
    ref = make_scheduler(tiny_hybrid_dir, tok, **kw, disable_radix_cache=True)
    a = tuple(tok(_prompts(tok)[2])["input_ids"])
    b = a[:70] + tuple(tok(" and something else entirely")["input_ids"])
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    busy = req(tok, "busy", "Count:", temperature=0, max_new_tokens=40, ignore_eos=True)
    run_until_done(s, {0: [busy], 1: [TokenizedGenerateReq("a", a, params)]})
    got = run_until_done(s, {0: [TokenizedGenerateReq("b", b, params)]})["b"]
    want = run_until_done(ref, {0: [TokenizedGenerateReq("b", b, params)]})["b"]
    assert got["ids"] == want["ids"] and got["cached_tokens"] == 64
