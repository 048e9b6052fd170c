"""``n`` > 1 through the real Engine: independent samples with derived seeds (reproducible),
greedy samples identical, one prompt prefill shared through the radix cache, one grammar
compile with a matcher per sample, and the per-sample seed derivation itself."""
from __future__ import annotations

import json
import uuid

import jsonschema
import pytest

from srt.frontend.samples import sample_seed, split_samples
from srt.transport.io_struct import TokenizedGenerateReq
from sampling.sampling_params import SamplingParams


def _fresh(prompt: str) -> str:
    return f"{prompt} [{uuid.uuid4().hex[:8]}]"  # nothing cached for it yet


def test_seeded_samples_are_reproducible_and_independent(fp32_engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "n": 4}
    first = fp32_engine.generate("Tell me a story about a cat.", params)
    again = fp32_engine.generate("Tell me a story about a cat.", params)
    assert isinstance(first, list) and len(first) == 4
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in first}) > 1  # different seeds, different samples
    assert [o["index"] for o in first] == [0, 1, 2, 3]
    # Sample 0 uses the request's own seed: the same as an n = 1 request.
    single = fp32_engine.generate("Tell me a story about a cat.", {**params, "n": 1})
    assert single["output_ids"] == first[0]["output_ids"]


def test_greedy_samples_are_identical(fp32_engine):
    outs = fp32_engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0, "n": 3})
    assert len({o["text"] for o in outs}) == 1


def test_samples_share_the_prompt_prefill(fp32_engine):
    prompt = _fresh("Summarise the history of the printing press in three sentences.")
    outs = fp32_engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0.8, "seed": 3, "n": 3})
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    prompt_tokens = outs[0]["meta_info"]["prompt_tokens"]
    assert cached[0] == 0  # the first prefills the prompt ...
    assert cached[1:] == [prompt_tokens - 1] * 2  # ... the others reuse all but its last token


def test_constrained_samples_each_follow_the_schema(fp32_engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    outs = fp32_engine.generate("Describe a person as JSON:", {
        "max_new_tokens": 40, "temperature": 1.0, "seed": 5, "n": 3, "json_schema": json.dumps(schema)})
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(o["text"]), schema)


def test_n_range_is_checked(fp32_engine):
    with pytest.raises(ValueError, match=r"n must be in \[1, 128\], got 0"):
        fp32_engine.generate("Hi", {"n": 0})
    with pytest.raises(ValueError, match=r"n must be in \[1, 128\], got 129"):
        fp32_engine.generate("Hi", {"n": 129})


def test_split_derives_a_seed_per_sample():
    req = TokenizedGenerateReq("r", (1, 2), SamplingParams(n=3, seed=9))
    parts = split_samples(req)
    assert [p.rid for p in parts] == ["r-0", "r-1", "r-2"]
    assert all(p.sampling_params.n == 1 and p.prefix_group == "r" for p in parts)
    seeds = [p.sampling_params.seed for p in parts]
    assert seeds[0] == 9 and len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [sample_seed(9, i) for i in range(3)]
    assert split_samples(TokenizedGenerateReq("u", (1,), SamplingParams(n=2)))[1].sampling_params.seed is None
