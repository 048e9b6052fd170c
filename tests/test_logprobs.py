"""Logprobs against a float64 reference computed from the model's own logits (transformers,
same weights), through the real Engine (scheduler processes, fp32): output and prompt
logprobs, top alternatives, temperature, grammar masks (masked tokens never listed, the
rest renormalised), chunked prefill, the radix cache, and raw mode."""
from __future__ import annotations

import math
import re

import pytest
import torch


TOL = 2e-3  # our fp32 engine vs the fp64 reference


@pytest.fixture(scope="module")
def engine(fp32_engine):
    return fp32_engine


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """float64 logprobs [T, V] of every position of a token sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float64)
    model.eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double()

    return logits


def _ids(tok, text):
    return tok(text)["input_ids"]


def test_greedy_output_and_prompt_logprobs_match_reference(engine, reference, smollm2_tokenizer):
    prompt = "The three primary colours are"
    out = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0},
                          return_logprob=True, top_logprobs_num=5, logprob_start_len=0)
    meta = out["meta_info"]
    p_ids = _ids(smollm2_tokenizer, prompt)
    full = p_ids + out["output_ids"]
    ref = torch.log_softmax(reference(full), -1)
    n = len(p_ids)
    outs = meta["output_token_logprobs"]
    assert [t for _, t, _ in outs] == out["output_ids"]
    for j, (lp, tok, text) in enumerate(outs):
        assert text is None
        assert abs(lp - ref[n + j - 1, tok].item()) < TOL
        top = meta["output_top_logprobs"][j]
        ref_top = torch.topk(ref[n + j - 1], 5)
        assert [t for _, t, _ in top] == ref_top.indices.tolist()
        assert all(abs(a[0] - b) < TOL for a, b in zip(top, ref_top.values.tolist()))
        assert top[0][1] == tok  # greedy: the chosen token is the most likely one
    ins = meta["input_token_logprobs"]
    assert len(ins) == n and ins[0][0] is None and meta["input_top_logprobs"][0] is None
    for q in range(1, n):
        assert ins[q][1] == p_ids[q]
        assert abs(ins[q][0] - ref[q - 1, p_ids[q]].item()) < TOL
        assert len(meta["input_top_logprobs"][q]) == 5


def test_temperature_is_part_of_the_reported_distribution(engine, reference, smollm2_tokenizer):
    prompt = "Once upon a time"
    out = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0.5, "seed": 7},
                          return_logprob=True, return_text_in_logprobs=True)
    full = _ids(smollm2_tokenizer, prompt) + out["output_ids"]
    ref = torch.log_softmax(reference(full) / 0.5, -1)
    n = len(full) - len(out["output_ids"])
    for j, (lp, tok, text) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - ref[n + j - 1, tok].item()) < TOL
        assert text == smollm2_tokenizer.decode([tok])
    assert "input_token_logprobs" not in out["meta_info"]


def test_grammar_masked_tokens_never_listed_and_rest_renormalised(engine, reference, smollm2_tokenizer):
    prompt = "Pick a number:"
    out = engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{3}"},
                          return_logprob=True, top_logprobs_num=20)
    meta = out["meta_info"]
    digits = re.compile(r"[0-9]{1,3}")
    first_top = meta["output_top_logprobs"][0]
    assert first_top and all(digits.fullmatch(smollm2_tokenizer.decode([t])) for _, t, _ in first_top)
    assert sum(math.exp(lp) for lp, _, _ in first_top) <= 1 + 1e-4
    # The first token's logprob is renormalised over exactly the tokens the regex allows.
    vocab = len(smollm2_tokenizer)
    allowed = [t for t in range(vocab) if digits.fullmatch(smollm2_tokenizer.decode([t]))]
    logits = reference(_ids(smollm2_tokenizer, prompt))[-1]
    tok = out["output_ids"][0]
    expected = (logits[tok] - torch.logsumexp(logits[allowed], 0)).item()
    assert abs(meta["output_token_logprobs"][0][0] - expected) < TOL


def test_long_prompt_logprobs_and_from_the_cache(engine, reference, smollm2_tokenizer):
    # Longer than one CPU prefill chunk (256 tokens); alone, it is one step (chunks only
    # protect running requests): test_chunked_prefill.py checks prompt logprobs in chunks.
    prompt = " ".join(f"item{i}" for i in range(120))
    p_ids = _ids(smollm2_tokenizer, prompt)
    assert len(p_ids) > 256
    ref = torch.log_softmax(reference(p_ids), -1)
    args = dict(return_logprob=True, logprob_start_len=5)
    first = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, **args)
    again = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0}, **args)  # cached now
    for out in (first, again):
        ins = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in ins] == p_ids[5:]
        for q, (lp, tok, _) in enumerate(ins, start=5):
            assert abs(lp - ref[q - 1, tok].item()) < TOL
    # The second is served whole from the cache (KV and logprobs; only its last token is
    # computed): the first's very numbers (test_prompt_logprob_cache.py).
    assert again["meta_info"]["cached_tokens"] == len(p_ids) - 1
    assert again["meta_info"]["input_token_logprobs"] == first["meta_info"]["input_token_logprobs"]


def test_scoring_with_max_new_tokens_0_alongside_generating_requests(engine, reference, smollm2_tokenizer):
    """max_new_tokens 0 + prompt logprobs: the prompt is prefilled and scored, nothing is
    sampled; requests batched with it generate exactly what they generate alone."""
    prompts = ["The capital of France is", "Water boils at", "One, two, three, four,"]
    greedy = {"max_new_tokens": 5, "temperature": 0}
    alone = engine.generate(prompts[1:], greedy)
    outs = engine.generate(prompts, [{"max_new_tokens": 0}, greedy, greedy],
                           return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    scored = outs[0]
    assert scored["output_ids"] == [] and scored["text"] == ""
    assert scored["meta_info"]["finish_reason"]["type"] == "length"
    p_ids = _ids(smollm2_tokenizer, prompts[0])
    ref = torch.log_softmax(reference(p_ids), -1)
    ins = scored["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in ins] == p_ids and ins[0][0] is None
    for q in range(1, len(p_ids)):
        assert abs(ins[q][0] - ref[q - 1, p_ids[q]].item()) < TOL
    assert [o["output_ids"] for o in outs[1:]] == [o["output_ids"] for o in alone]
    # Without logprobs nothing needs computing: it finishes at once.
    plain = engine.generate(prompts[0], {"max_new_tokens": 0})
    assert plain["output_ids"] == [] and plain["meta_info"]["finish_reason"]["type"] == "length"


def test_bad_logprob_fields_are_rejected(engine):
    with pytest.raises(ValueError, match="top_logprobs_num must be in \\[0, 20\\]"):
        engine.generate("Hi", {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=21)
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.generate("Hi", {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=50)
    with pytest.raises(ValueError, match="asks for logprobs: send return_logprob: true"):
        engine.generate("Hi", {"max_new_tokens": 1}, top_logprobs_num=2)


def test_raw_mode_reports_the_model_distribution(smollm2_dir, smollm2_tokenizer, reference):
    """--logprobs-mode raw_logprobs ignores penalties, masks and temperature."""
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import LogprobRequest, TokenizedGenerateReq
    from srt.scheduler.scheduler import Scheduler
    from srt.model_executor.model_config import ModelConfig
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=smollm2_dir, dtype="float32", random_seed=0, max_total_tokens=1024,
                      logprobs_mode="raw_logprobs")
    s = Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(smollm2_dir, None), smollm2_tokenizer)
    ids = tuple(_ids(smollm2_tokenizer, "Pick a number:"))
    params = SamplingParams(max_new_tokens=3, temperature=0.3, seed=1, regex="[0-9]{3}",
                            frequency_penalty=1.5)
    s.process_input_requests([TokenizedGenerateReq("raw", ids, params, logprobs=LogprobRequest(top_n=3))])
    got, logprobs = [], []
    for _ in range(200):
        for batch in s.step():
            got.extend(batch.new_token_ids[0])
            logprobs.extend(batch.output_logprobs[0].token_logprobs)
        if not s.has_work():
            break
    ref = torch.log_softmax(reference(list(ids) + got), -1)
    for j, (tok, lp) in enumerate(zip(got, logprobs)):
        assert abs(lp - ref[len(ids) + j - 1, tok].item()) < TOL
