"""Every serving feature on a mixture-of-experts model: the tiny model's Qwen3-MoE twin
(tests/tiny_model.py ``MOE_CONFIG``: random weights, SmolLM2's tokenizer; 3 MoE layers
and one dense) in real engines, fp32, eager unless a test compiles.

One reference engine (radix cache on) gives the greedy answers; each feature's engine must
give the very same tokens: chunked prefill with mixed chunks, n-gram speculation, TP=2
with the experts split, TP=2 with whole experts per rank (EP=2, their batch logs identical
down to the ROUTING digests), PP=2, the compiled steps (prefill and the decode package).
On the reference engine: the radix cache's hits, JSON schemas under every grammar backend
(auto, xgrammar, llguidance), ``n`` = 2 seeded samples, logprobs and prompt
logprobs served again from the cache. Quantized weights are refused with a clear message.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from test_grammar_agreement_ranks import _identical_batch_logs

BASE = dict(dtype="float32", disable_torch_compile=True, max_total_tokens=4096,
            max_running_requests=8, random_seed=0)
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _prompts(tok) -> list[str]:
    long = " ".join(f"Item {i} of the list is stored on shelf {i % 7}." for i in range(14))
    assert len(tok(long)["input_ids"]) > 100  # several 32-token chunks
    return ["The capital of France is", "def fibonacci(n):", long, "One, two, three, four,"]


def _greedy(engine, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def ref(tiny_moe_dir, smollm2_tokenizer):
    from srt.entrypoints.engine import Engine

    with Engine(model_path=tiny_moe_dir, **BASE) as engine:
        prompts = _prompts(smollm2_tokenizer)
        alone = [_greedy(engine, [p])[0] for p in prompts]
        yield engine, prompts, alone


def test_a_batch_gives_what_each_prompt_gives_alone_and_the_cache_hits(ref):
    engine, prompts, alone = ref
    assert len({tuple(a) for a in alone}) == len(alone)  # the prompts do not collapse to one answer
    outs = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == alone
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)  # each prompt ran alone before


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_json_schema_on_every_grammar_backend(ref, tiny_moe_dir, backend):
    from srt.entrypoints.engine import Engine

    params = {"temperature": 0, "max_new_tokens": 80, "json_schema": json.dumps(SCHEMA)}
    if backend == "auto":  # the reference engine's (the default)
        out = ref[0].generate("A person as JSON:", params)
    else:
        with Engine(model_path=tiny_moe_dir, grammar_backend=backend, **BASE) as other:
            out = other.generate("A person as JSON:", params)
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_n2_seeded_samples_and_logprobs_from_the_cache(ref):
    engine, prompts, _ = ref
    params = {"temperature": 0.8, "max_new_tokens": 12, "n": 2, "seed": 7}
    a, b = engine.generate(prompts[0], params), engine.generate(prompts[0], params)
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    assert a[0]["output_ids"] != a[1]["output_ids"]  # two samples, not one copied
    kw = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    first = engine.generate(prompts[1], {"max_new_tokens": 4, "temperature": 0}, **kw)["meta_info"]
    again = engine.generate(prompts[1], {"max_new_tokens": 4, "temperature": 0}, **kw)["meta_info"]
    assert again["cached_tokens"] > 0
    for key in ("input_token_logprobs", "input_top_logprobs"):  # served from the cache: bit for bit
        assert first[key] == again[key], key
    # Computed again over a shorter prefill: the same within fp32 rounding, as for a dense model.
    for x, y in zip(first["output_token_logprobs"], again["output_token_logprobs"]):
        assert x[1] == y[1] and abs(x[0] - y[0]) < 1e-5
    assert len(first["input_token_logprobs"]) == first["prompt_tokens"]


FEATURES = {
    "chunked+mixed": dict(chunked_prefill_size=32, enable_mixed_chunk=True),
    "ngram-speculation": dict(speculative_algorithm="NGRAM"),
    "tp2": dict(tp_size=2),
    "tp2-ep2": dict(tp_size=2, ep_size=2),
    "pp2": dict(pp_size=2),
    # The compiled prefill and the decode step's AOTInductor package (batch 1: one graph).
    "compiled": dict(disable_torch_compile=False, enable_torch_compile=True, wait_for_torch_compile=True,
                     max_running_requests=1),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_gives_the_reference_tokens(ref, tiny_moe_dir, feature, tmp_path, monkeypatch):
    from srt.entrypoints.engine import Engine

    _, prompts, alone = ref
    logs = tmp_path / "batches"
    monkeypatch.setenv("GRAMSYNC_BATCH_LOG_DIR", str(logs))
    with Engine(model_path=tiny_moe_dir, **{**BASE, **FEATURES[feature]}) as engine:
        assert [_greedy(engine, [p])[0] for p in prompts] == alone
        assert _greedy(engine, prompts) == alone
    if feature.startswith("tp2"):
        assert _identical_batch_logs(logs)  # the same batches and expert choices on both ranks
    log = (logs / ("batches_DP0_PP0_TP0.log" if feature == "pp2" else "batches_DP0_TP0.log")).read_text()
    steps = sum(line.split(" ")[1] in ("EXTEND", "DECODE", "MIXED") for line in log.splitlines())
    routed = sum(" ROUTING " in line for line in log.splitlines())
    # An eager step records its expert choices; a compiled one cannot see them (and every
    # step of the compiled engine ran compiled: --wait-for-torch-compile).
    assert steps > 0 and routed == (0 if feature == "compiled" else steps), (routed, steps)


def test_quantized_weights_are_refused(tiny_moe_dir):
    from srt.entrypoints.engine import Engine

    with pytest.raises(RuntimeError, match="int4wo-64: quantized experts are not built yet"):
        Engine(model_path=tiny_moe_dir, torchao_config="int4wo-64", **BASE)
