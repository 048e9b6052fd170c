"""The compiled decode step (torch.compile + Inductor freezing) against the eager step.

Real model (the embedded SmolLM2), real scheduler, in fp32: greedy tokens must be
identical with and without compile on the benchmark's prompts (bench_offline.py), over
batch 1 and a batch of several sequences of different lengths (the dynamic graph).

Both schedulers serve the model's first ``LAYERS`` layers (``--json-model-override-args``):
the compile's cost grows with depth (on a 2-vCPU AVX2 machine in fp32, ~290 s for all 30
layers, ~50 s for 4) while what is checked here -- the compiled graphs give the eager
tokens and logprobs, the switch, the fallbacks -- does not depend on it. The full depth
compiles in every ``make serve`` and in the benchmarks (bench_offline.py, bench_prefill_compile.py).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from bench_offline import chat_prompts  # noqa: E402  the benchmark's own prompts

NEW_TOKENS = 24
LAYERS = 4


def _scheduler(model_dir, tokenizer, **kwargs):
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.scheduler.scheduler import Scheduler
    from srt.model_executor.model_config import ModelConfig
    from srt.server_args import ServerArgs, parse_model_overrides

    overrides = f'{{"num_hidden_layers": {LAYERS}}}'
    args = ServerArgs(model_path=model_dir, random_seed=0, dtype="float32", max_running_requests=8,
                      max_total_tokens=4096, json_model_override_args=overrides, **kwargs)
    config = ModelConfig.from_path(model_dir, None, parse_model_overrides(overrides))
    assert config.num_hidden_layers == LAYERS
    return Scheduler(args, RankInfo(), SINGLE_RANK, config, tokenizer)


def _greedy(sched, tokenizer, prompts, tag) -> dict[str, list[int]]:
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    reqs = [TokenizedGenerateReq(f"{tag}-{i}", tuple(tokenizer.apply_chat_template(
        m, add_generation_prompt=True, tokenize=True, return_dict=False)), params)
        for i, m in enumerate(prompts)]
    sched.process_input_requests(reqs)
    by_rid = {r.rid: r for r in (sched.reqs[m.rid] for m in reqs)}
    while sched.has_work():
        sched.step()
    return {rid: list(r.output_ids) for rid, r in by_rid.items()}


@pytest.fixture(scope="module")
def schedulers(smollm2_dir, smollm2_tokenizer):
    torch.set_grad_enabled(False)
    # TP=1: compiles in the background thread; one compile for the module. Without the
    # compile cache: the builder process and the cache are test_compile_cache.py's, and
    # the builder would add its own compile (~2 minutes) before this one.
    with mock.patch.dict(os.environ, {"GRAMSYNC_COMPILE_CACHE": "0"}):
        compiled = _scheduler(smollm2_dir, smollm2_tokenizer, enable_torch_compile=True)
    eager = _scheduler(smollm2_dir, smollm2_tokenizer, disable_torch_compile=True)
    return compiled, eager


@pytest.mark.timeout(600)  # the 4-layer compile takes ~50 s on a 2-vCPU AVX2 machine (fp32)
def test_serves_eagerly_while_compiling_then_switches(schedulers, smollm2_tokenizer):
    """Requests are answered while the step compiles; after the switch, same tokens."""
    compiled, eager = schedulers
    cd = compiled.runner.compiled_decode
    assert cd is not None and eager.runner.compiled_decode is None
    t = time.monotonic()
    during = _greedy(compiled, smollm2_tokenizer, chat_prompts(2), "bg")
    assert all(len(v) == NEW_TOKENS for v in during.values())
    assert cd.wait(timeout=600), "compile did not finish (or failed: see the warning)"
    after = _greedy(compiled, smollm2_tokenizer, chat_prompts(2), "bg2")
    assert list(after.values()) == list(during.values())
    assert time.monotonic() - t < 600


@pytest.mark.parametrize("batch", [1, 6])
def test_fp32_greedy_identical_with_and_without_compile(schedulers, smollm2_tokenizer, batch):
    compiled, eager = schedulers
    assert compiled.runner.compiled_decode.wait(timeout=600)
    prompts = chat_prompts(batch)
    got = _greedy(compiled, smollm2_tokenizer, prompts, f"c{batch}")
    want = _greedy(eager, smollm2_tokenizer, prompts, f"e{batch}")
    assert list(got.values()) == list(want.values())
    assert all(len(v) == NEW_TOKENS for v in got.values())
    assert compiled.runner.compiled_decode.ready  # no fallback to eager happened on the way


def test_batches_past_max_bs_run_eagerly(smollm2_dir, smollm2_tokenizer, schedulers):
    compiled, _ = schedulers
    cd = compiled.runner.compiled_decode
    assert cd.max_bs == 8  # min(--torch-compile-max-bs, --max-running-requests)
    from srt.model_executor.forward_batch import ForwardBatch, ForwardMode

    big = ForwardBatch(ForwardMode.DECODE, *([torch.zeros(9, dtype=torch.long)] * 5),
                       [1] * 9, [1] * 9, [0] * 9, None, None)
    assert not cd.can_run(big)


def _prompt_logprobs(sched, prompts: list[list[int]], tag: str) -> list[list[float]]:
    """Each prompt's token logprobs (prefill only: ``max_new_tokens`` 0)."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import LogprobRequest, TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 0})
    reqs = [TokenizedGenerateReq(f"{tag}-{i}", tuple(p), params, logprobs=LogprobRequest(top_n=1, start_len=0))
            for i, p in enumerate(prompts)]
    sched.process_input_requests(reqs)
    out: dict[str, list[float]] = {}
    while sched.has_work():
        for batch in sched.step():
            for k, rid in enumerate(batch.rids):
                if batch.input_logprobs and batch.input_logprobs[k] is not None:
                    out[rid] = list(batch.input_logprobs[k].token_logprobs)
    return [out[m.rid] for m in reqs]


def test_compiled_prefill_scores_prompts_as_eager_does(schedulers, smollm2_tokenizer):
    """The compiled prefill (TP=1, after the warm-up) gives the eager prefill's prompt
    logprobs in fp32 (to 1e-4) on a batch of prompts of different lengths."""
    compiled, eager = schedulers
    assert compiled.runner.compiled_decode.wait(timeout=600)
    cp = compiled.runner.compiled_prefill
    assert cp is not None and cp.ready and eager.runner.compiled_prefill is None
    tok = smollm2_tokenizer
    prompts = [tok(t)["input_ids"] for t in ("The capital of France is Paris, and its river is the Seine.",
                                             "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
                                             "def add(a, b):\n    return a + b\n")]
    before = cp.steps
    got = _prompt_logprobs(compiled, prompts, "cp")
    want = _prompt_logprobs(eager, prompts, "ep")
    assert cp.steps > before and cp.ready  # served by the compiled graphs, no fallback
    for g, w in zip(got, want):
        assert g[0] is None and w[0] is None and len(g) == len(w)
        assert max(abs(a - b) for a, b in zip(g[1:], w[1:])) < 1e-4


def test_mixed_steps_through_the_compiled_prefill_match_eager(schedulers, smollm2_tokenizer):
    """--enable-mixed-chunk: a prompt arriving while others decode is prefilled in the same
    forward as their decode rows, through the compiled prefill and its compiled decode
    attention; fp32 greedy tokens equal the eager scheduler's mixed steps."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    compiled, eager = schedulers
    assert compiled.runner.compiled_decode.wait(timeout=600)
    cp = compiled.runner.compiled_prefill
    tok = smollm2_tokenizer
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    outs = {}
    for sched, tag in ((compiled, "cm"), (eager, "em")):
        sched.mixed_chunk = True
        sched.step_stats.reset()
        steps_before = cp.steps
        try:
            ids = [tuple(tok(p)["input_ids"]) for p in ("Once upon a time", "The ocean is", "List three colours:")]
            sched.process_input_requests([TokenizedGenerateReq(f"{tag}0", ids[0], params),
                                          TokenizedGenerateReq(f"{tag}1", ids[1], params)])
            reqs = dict(sched.reqs)
            for _ in range(3):
                sched.step()
            sched.process_input_requests([TokenizedGenerateReq(f"{tag}2", ids[2], params)])
            reqs.update(sched.reqs)
            while sched.has_work():
                sched.step()
        finally:
            sched.mixed_chunk = False
        assert "MIXED" in sched.step_stats.by_mode
        outs[tag] = [list(reqs[f"{tag}{i}"].output_ids) for i in range(3)]
        if sched is compiled:
            assert cp.steps > steps_before and cp.ready  # compiled, no fallback
    assert outs["cm"] == outs["em"]


def _greedy_ids(sched, prompts: list[list[int]], tag: str) -> list[list[int]]:
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    reqs = [TokenizedGenerateReq(f"{tag}-{i}", tuple(p), params) for i, p in enumerate(prompts)]
    sched.process_input_requests(reqs)
    by_rid = {m.rid: sched.reqs[m.rid] for m in reqs}
    while sched.has_work():
        sched.step()
    return [list(by_rid[m.rid].output_ids) for m in reqs]


def test_short_prefills_run_as_decode_rows_with_the_eager_prefills_tokens(schedulers, smollm2_tokenizer):
    """Prompts already cached (sent again: one new token each) and cached prompts followed
    by a few new tokens, within the decode graphs' rows: no compiled prefill step runs
    (extend_as_decode.py), and the fp32 greedy tokens equal the eager prefill's."""
    compiled, eager = schedulers
    assert compiled.runner.compiled_decode.wait(timeout=600)
    cp = compiled.runner.compiled_prefill
    tok = smollm2_tokenizer
    prompts = [tok(t)["input_ids"] for t in ("The capital of France is Paris, and its river is the",
                                             "1, 2, 3, 4, 5, 6, 7, 8, 9,")]
    more = [p + tok(t, add_special_tokens=False)["input_ids"] for p, t in zip(prompts, (" Seine.", " 10,"))]
    assert 2 < sum(len(m) - len(p) for m, p in zip(more, prompts)) <= compiled.runner.compiled_decode.max_bs
    for sched in (compiled, eager):
        _greedy_ids(sched, prompts, "cache")  # the prompts into each radix cache
    before = cp.steps
    got = [_greedy_ids(compiled, batch, "again") for batch in (prompts, more)]
    assert cp.steps == before and cp.ready and compiled.runner.compiled_decode.ready
    want = [_greedy_ids(eager, batch, "again") for batch in (prompts, more)]
    assert got == want
    assert _greedy_ids(compiled, [prompts[0] + more[1]], "long") and cp.steps > before  # past the rows: a prefill
