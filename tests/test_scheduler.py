"""Scheduler on one rank with the real embedded SmolLM2 (no mocks): continuous batching,
finish reasons, abort, KV accounting, determinism inside a busy batch."""
from __future__ import annotations

import pytest
import torch

from distributed.parallel_state import SINGLE_RANK, RankInfo
from sampling.custom_logit_processor import CustomLogitProcessor
from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import AbortReq, TokenizedGenerateReq
from srt.scheduler.scheduler import Scheduler
from srt.model_executor.model_config import ModelConfig
from srt.server_args import ServerArgs
from srt.tokenizer_utils import apply_chat_template

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Explain what a compiler does in one sentence, please, and keep it short.",
    "def fibonacci(n):",
    "Hello",
]


def make_scheduler(model_dir, tokenizer, **kw) -> Scheduler:
    kw.setdefault("dtype", "float32")  # reduction-order assertions below assume fp32
    args = ServerArgs(model_path=model_dir, random_seed=0, **kw)
    cfg = ModelConfig.from_path(model_dir, args.context_length)
    return Scheduler(args, RankInfo(), SINGLE_RANK, cfg, tokenizer)


@pytest.fixture(scope="module")
def sched(smollm2_dir, smollm2_tokenizer):
    s = make_scheduler(smollm2_dir, smollm2_tokenizer, max_total_tokens=4096,
                       max_running_requests=16)
    yield s
    assert not s.has_work()
    s.kv.check_idle_integrity()


def run_until_done(s: Scheduler, arrivals: dict[int, list] | None = None, max_steps=2000):
    """Step the scheduler; ``arrivals[step]`` messages are fed before that step."""
    arrivals = arrivals or {}
    outs: dict[str, dict] = {}
    step = 0
    while s.has_work() or any(k >= step for k in arrivals):
        s.process_input_requests(arrivals.get(step, []))
        for batch in s.step():
            for i, rid in enumerate(batch.rids):
                o = outs.setdefault(rid, {"ids": [], "finish": None, "steps": 0})
                o["ids"].extend(batch.new_token_ids[i])
                o["finish"] = batch.finished_reasons[i]
                o["completion_tokens"] = batch.completion_tokens[i]
                o["prompt_tokens"] = batch.prompt_tokens[i]
                o["cached_tokens"] = batch.cached_tokens[i]
                if batch.input_logprobs and batch.input_logprobs[i] is not None:
                    o["input_logprobs"] = list(batch.input_logprobs[i].token_logprobs)
        step += 1
        assert step < max_steps, "scheduler did not finish"
    s.kv.check_idle_integrity()
    return outs


def req(tok, rid, prompt, **params):
    ids = tuple(tok(prompt)["input_ids"])
    return TokenizedGenerateReq(rid, ids, SamplingParams(**params))


def test_mixed_arrivals_finish_with_right_reasons(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    alone = run_until_done(sched, {0: [req(tok, "probe", PROMPTS[1], temperature=0,
                                           max_new_tokens=12, ignore_eos=True)]})
    probe_ids = alone["probe"]["ids"]
    stop_token = probe_ids[5]
    stop_text = tok.decode(probe_ids[3:5])
    arrivals = {
        0: [req(tok, "len", PROMPTS[0], temperature=0, max_new_tokens=7, ignore_eos=True)],
        2: [req(tok, "stop_id", PROMPTS[1], temperature=0, max_new_tokens=12, ignore_eos=True,
                stop_token_ids=(stop_token,))],
        3: [req(tok, "stop_str", PROMPTS[1], temperature=0, max_new_tokens=12, ignore_eos=True,
                stop=(stop_text,))],
        5: [req(tok, "sampled", PROMPTS[3], temperature=0.8, top_p=0.9, top_k=40, seed=7,
                max_new_tokens=9, ignore_eos=True)],
    }
    outs = run_until_done(sched, arrivals)
    assert outs["len"]["finish"].type == "length" and len(outs["len"]["ids"]) == 7
    assert outs["stop_id"]["finish"].type == "stop"
    assert outs["stop_id"]["finish"].matched == stop_token
    assert outs["stop_id"]["ids"] == probe_ids[:probe_ids.index(stop_token) + 1]
    assert outs["stop_str"]["finish"].type == "stop"
    assert outs["stop_str"]["finish"].matched == stop_text
    assert stop_text in tok.decode(outs["stop_str"]["ids"])
    assert len(outs["stop_str"]["ids"]) <= 5
    assert outs["sampled"]["finish"].type == "length" and len(outs["sampled"]["ids"]) == 9
    assert outs["len"]["prompt_tokens"] == len(tok(PROMPTS[0])["input_ids"])


def test_eos_finishes_with_stop(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tuple(apply_chat_template(tok, [{"role": "user", "content": "Say hi."}]))
    outs = run_until_done(sched, {0: [TokenizedGenerateReq(
        "chat", ids, SamplingParams(temperature=0, max_new_tokens=64))]})
    o = outs["chat"]
    assert o["finish"].type == "stop", o
    assert o["ids"][-1] in sched.eos_ids and o["finish"].matched == o["ids"][-1]


def last_logits(s: Scheduler, ids: list[int]) -> torch.Tensor:
    """Logits after prefilling ``ids`` alone (captured from the real forward)."""
    seen = []
    orig = s.runner.forward
    s.runner.forward = lambda fb: seen.append(orig(fb)) or seen[-1]
    try:
        run_until_done(s, {0: [TokenizedGenerateReq("probe-logits", tuple(ids),
                                                    SamplingParams(temperature=0, max_new_tokens=1))]})
    finally:
        s.runner.forward = orig
    return seen[0][0]


def test_greedy_same_alone_and_in_busy_batch(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    target = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
    t_req = req(tok, "t", PROMPTS[3], **target)
    alone = run_until_done(sched, {0: [t_req]})["t"]["ids"]
    arrivals = {0: [req(tok, f"busy{i}", p, temperature=0.7, seed=i, max_new_tokens=10 + i,
                        ignore_eos=True) for i, p in enumerate(PROMPTS[:3])],
                1: [t_req],
                4: [req(tok, f"late{i}", p, temperature=0, max_new_tokens=6, ignore_eos=True)
                    for i, p in enumerate(PROMPTS[4:])]}
    busy = run_until_done(sched, arrivals)["t"]["ids"]
    if busy != alone:
        # Acceptable only as a floating-point near-tie: the two candidates' logits must be
        # within reduction-order noise at the first differing position.
        i = next(k for k, (a, b) in enumerate(zip(alone, busy)) if a != b)
        logits = last_logits(sched, list(t_req.input_ids) + alone[:i])
        gap = abs(float(logits[alone[i]] - logits[busy[i]]))
        assert gap < 1e-4 * float(logits.abs().max()), (
            f"greedy output diverged at token {i} with logit gap {gap}: not a near-tie")


def test_seeded_sampling_reproducible_in_any_batch(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    p = dict(temperature=1.0, top_k=50, seed=1234, max_new_tokens=10, ignore_eos=True)
    a = run_until_done(sched, {0: [req(tok, "s", PROMPTS[2], **p)]})["s"]["ids"]
    b = run_until_done(sched, {0: [req(tok, "x", PROMPTS[0], temperature=1.0, max_new_tokens=5,
                                       ignore_eos=True), req(tok, "s", PROMPTS[2], **p)]})["s"]["ids"]
    c = run_until_done(sched, {0: [req(tok, "s", PROMPTS[2], **{**p, "seed": 99})]})["s"]["ids"]
    assert a == b
    assert a != c


def test_abort_frees_kv(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    free0 = sched.kv.available_tokens()
    sched.process_input_requests([req(tok, "long", PROMPTS[3], temperature=0,
                                      max_new_tokens=500, ignore_eos=True),
                                  req(tok, "queued", PROMPTS[0], max_new_tokens=5)])
    sched.step()
    sched.step()
    assert sched.kv.available_tokens() < free0
    outs = run_until_done(sched, {0: [AbortReq("long"), AbortReq("unknown-rid")]})
    assert outs["long"]["finish"].type == "abort"
    assert outs["queued"]["finish"] is not None
    assert sched.kv.available_tokens() == free0


def test_abort_while_waiting(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    sched.process_input_requests([req(tok, "w", PROMPTS[0], max_new_tokens=5)])
    outs = run_until_done(sched, {0: [AbortReq("w", "gone", 499)]})
    assert outs["w"]["finish"].type == "abort" and outs["w"]["finish"].message == "gone"
    assert outs["w"]["ids"] == []


def test_rejects_what_can_never_fit(smollm2_dir, smollm2_tokenizer):
    s = make_scheduler(smollm2_dir, smollm2_tokenizer, max_total_tokens=48,
                       context_length=64, max_running_requests=4)
    long_ids = tuple(range(100, 170))
    mid_ids = tuple(range(100, 150))
    outs = run_until_done(s, {0: [
        TokenizedGenerateReq("ctx", long_ids, SamplingParams(max_new_tokens=4)),
        TokenizedGenerateReq("pool", mid_ids, SamplingParams(max_new_tokens=4)),
        TokenizedGenerateReq("vocab", (1, 10**7), SamplingParams(max_new_tokens=4)),
        TokenizedGenerateReq("ok", tuple(range(100, 110)), SamplingParams(max_new_tokens=4)),
    ]})
    assert "longer than the model's context length (64 tokens)" in outs["ctx"]["finish"].message
    assert "can never fit in the KV cache (max_total_tokens=48)" in outs["pool"]["finish"].message
    assert "Input token ids must be in" in outs["vocab"]["finish"].message
    assert outs["ok"]["finish"].type in ("length", "stop")


@pytest.mark.parametrize("clip", [4096, 1])
def test_small_pool_queues_and_retracts_without_changing_outputs(
        smollm2_dir, smollm2_tokenizer, monkeypatch, clip):
    """A pool far smaller than the load: requests wait (clip=4096 reserves their whole
    output) or are admitted optimistically and retracted (clip=1), never lost, and greedy
    outputs equal those of a roomy pool."""
    tok = smollm2_tokenizer
    monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", str(clip))
    s = make_scheduler(smollm2_dir, tok, max_total_tokens=96, max_running_requests=8)
    reqs = [req(tok, f"r{i}", p, temperature=0, max_new_tokens=20, ignore_eos=True)
            for i, p in enumerate(PROMPTS)]
    small = run_until_done(s, {0: reqs})
    big = make_scheduler(smollm2_dir, tok, max_total_tokens=2048, max_running_requests=8)
    ref = run_until_done(big, {0: reqs})
    for r in reqs:
        assert small[r.rid]["finish"].type == "length"
        assert small[r.rid]["ids"] == ref[r.rid]["ids"]
    assert (s.num_retractions > 0) == (clip == 1)


def test_waiting_and_running_timeouts_become_aborts(sched, smollm2_tokenizer, monkeypatch):
    """Timeouts are decided from wall-clock on the entry rank and fed back as AbortReqs."""
    import time

    tok = smollm2_tokenizer
    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "0.05")
    sched.process_input_requests([req(tok, "slow-queue", PROMPTS[0], max_new_tokens=50)])
    time.sleep(0.1)
    timeouts = sched.collect_timeouts()
    assert [t.rid for t in timeouts] == ["slow-queue"]
    outs = run_until_done(sched, {0: timeouts})
    assert "SGLANG_REQ_WAITING_TIMEOUT" in outs["slow-queue"]["finish"].message
    monkeypatch.delenv("SGLANG_REQ_WAITING_TIMEOUT")
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "0.05")
    sched.process_input_requests([req(tok, "slow-run", PROMPTS[0], max_new_tokens=500,
                                      ignore_eos=True)])
    sched.step()
    time.sleep(0.1)
    outs = run_until_done(sched, {0: sched.collect_timeouts()})
    assert outs["slow-run"]["finish"].type == "abort"
    assert "SGLANG_REQ_RUNNING_TIMEOUT" in outs["slow-run"]["finish"].message
    assert 0 < len(outs["slow-run"]["ids"]) < 500


class RaisingProcessor(CustomLogitProcessor):
    """A buggy user processor: it must abort its own request only."""

    def __call__(self, logits, custom_param_list):
        raise RuntimeError("boom")


def test_failing_custom_logit_processor_aborts_only_its_request(sched, smollm2_tokenizer):
    tok = smollm2_tokenizer
    bad = req(tok, "bad", PROMPTS[0], temperature=0, max_new_tokens=6, ignore_eos=True,
              custom_logit_processor=RaisingProcessor.to_str())
    good = req(tok, "good", PROMPTS[1], temperature=0, max_new_tokens=6, ignore_eos=True)
    late = req(tok, "late", PROMPTS[2], temperature=0, max_new_tokens=4, ignore_eos=True)
    outs = run_until_done(sched, {0: [good], 2: [bad], 3: [late]})
    assert outs["bad"]["finish"].type == "abort"
    assert outs["bad"]["finish"].status_code == 500
    assert "Custom logit processor failed: RuntimeError: boom" in outs["bad"]["finish"].message
    alone = run_until_done(sched, {0: [req(tok, "good2", PROMPTS[1], temperature=0,
                                           max_new_tokens=6, ignore_eos=True)]})
    assert outs["good"]["ids"] == alone["good2"]["ids"]
    assert len(outs["late"]["ids"]) == 4


def test_bounded_queue_rejects_at_once_and_keeps_what_it_accepted(smollm2_dir, smollm2_tokenizer):
    """--max-queued-requests: past the limit a new request is a 503 at once; accepted ones
    all finish, and once the queue drains new requests are accepted again."""
    s = make_scheduler(smollm2_dir, smollm2_tokenizer, max_total_tokens=1024, max_queued_requests=2)
    tok = smollm2_tokenizer
    outs = run_until_done(s, {0: [req(tok, f"q{i}", PROMPTS[i], max_new_tokens=3) for i in range(5)]})
    assert [outs[f"q{i}"]["finish"].type for i in range(5)] == ["length", "length", "abort", "abort", "abort"]
    rejected = outs["q2"]["finish"]
    assert rejected.status_code == 503 and "--max-queued-requests" in rejected.message
    assert outs["q2"]["ids"] == []
    later = run_until_done(s, {0: [req(tok, "later", PROMPTS[0], max_new_tokens=2)]})
    assert later["later"]["finish"].type == "length"
