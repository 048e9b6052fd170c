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

from srt.frontend.samples import split_samples
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
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=2048, max_running_requests=8)
    assert s.kv.tree is None and s.runner.state_pool is not None  # radix cache off for hybrids
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
    """n = 4 as the frontend sends it (four samples of one prefix group, samples.py): each
    sample prefills its own state (no radix cache to share one), greedy equal to the prompt
    alone; seeded samples reproducible and distinct."""
    tok = smollm2_tokenizer
    s = make_scheduler(tiny_hybrid_dir, tok, max_total_tokens=2048, max_running_requests=8)
    prompt = _prompts(tok)[2]
    outs = run_until_done(s, {0: split_samples(req(tok, "n", prompt, n=4, **GREEDY))})
    assert [outs[f"n-{i}"]["ids"] for i in range(4)] == [alone[2]] * 4
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
    ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm NGRAM"),
    ({"torchao_config": "int8wo"}, "--torchao-config int8wo"),
    ({"enable_torch_compile": True}, "--enable-torch-compile"),
])
def test_combinations_not_built_yet_are_refused(tiny_hybrid_dir, kw, what):
    args = ServerArgs(model_path=tiny_hybrid_dir, **kw)
    with pytest.raises(ValueError, match=f"hybrid Gated DeltaNet model: {what} is not built yet"):
        hybrid_serving_args(args, ModelConfig.from_path(tiny_hybrid_dir))


def test_what_is_switched_off_is_said(tiny_hybrid_dir, tiny_dir):
    served, notes = hybrid_serving_args(ServerArgs(model_path=tiny_hybrid_dir), ModelConfig.from_path(tiny_hybrid_dir))
    assert served.disable_radix_cache and served.disable_torch_compile
    assert any("radix prefix cache off" in n for n in notes)
    dense = ServerArgs(model_path=tiny_dir)
    assert hybrid_serving_args(dense, ModelConfig.from_path(tiny_dir)) == (dense, ())


def test_engine_reports_the_state_pool_and_serves_n2(tiny_hybrid_dir):
    """Real processes: the state pool and what is switched off reach /get_server_info's
    scheduler info; n = 2 through the frontend's sample split."""
    from srt.entrypoints.engine import Engine

    with Engine(model_path=tiny_hybrid_dir, dtype="float32", max_total_tokens=1024,
                max_running_requests=4, random_seed=0) as engine:
        info = engine.scheduler_info
        assert info.linear_state_slots == 4 and info.linear_state_bytes_per_slot > 0
        assert any("radix prefix cache off" in n for n in info.model_limits)
        outs = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8, "n": 2})
        assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]
