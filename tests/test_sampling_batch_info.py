"""SamplingBatchInfo kept in step by filter_batch / merge_batch equals a fresh from_reqs of
the same requests (penalizer state included); and, with a real scheduler of the suite's tiny model, every
request whose batch loses and gains rows (or which is retracted and resumed) produces
exactly the tokens it produces alone. Neither a custom processor nor a logit bias lifts the
grammar mask, on every CPU path of the bitmask apply."""
from __future__ import annotations

import random

import pytest
import torch
import xgrammar

from constrained import bitmask_ops
from constrained.bitmask_ops import unpack_bitmask
from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from distributed.parallel_state import SINGLE_RANK, RankInfo
from srt.transport.io_struct import TokenizedGenerateReq
from srt.scheduler.req import Req
from srt.scheduler.scheduler import Scheduler
from srt.model_executor.model_config import ModelConfig
from srt.server_args import ServerArgs
from test_custom_logit_processor import BoostTokens

V, EOS = 8, 7
_TENSORS = ("temperatures", "top_ps", "top_ks", "min_ps", "greedy_mask")
_LISTS = ("seeds", "positions", "logit_bias", "custom_processors", "custom_params", "grammars")
_FLAGS = ("is_all_greedy", "has_greedy", "need_top_k", "need_top_p", "need_min_p")

PARAMS = [
    dict(temperature=0),
    dict(temperature=0.8, seed=3),
    dict(temperature=1.0, top_k=3, seed=4),
    dict(temperature=0.9, top_p=0.8, min_p=0.1, seed=5, frequency_penalty=0.5),
    dict(temperature=0, top_k=5, repetition_penalty=1.5, presence_penalty=0.3,
         logit_bias=((2, 1.5), (6, -2.0))),
    dict(temperature=0.7, seed=6, min_new_tokens=3, stop_token_ids=(4,), presence_penalty=-0.7),
    dict(temperature=1.0, top_k=2, seed=7, repetition_penalty=0.6, frequency_penalty=1.2,
         logit_bias=((1, 3.0),)),
]


def mk(i: int, n: int) -> Req:
    """Request ``n`` with parameter set ``i``, a short prompt and some earlier output."""
    r = Req(f"r{n}", (n % V, (3 * n + 1) % V), SamplingParams(max_new_tokens=50, **PARAMS[i]),
            False, frozenset({EOS}))
    r.output_ids = [(n + k) % V for k in range(n % 3)]
    return r


def from_reqs(reqs) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(reqs, V, "cpu", torch.Generator().manual_seed(0))


def assert_same(info: SamplingBatchInfo, reqs: list[Req]) -> None:
    """``info`` behaves exactly like a fresh ``from_reqs(reqs)``."""
    ref = from_reqs(reqs)
    assert len(info) == len(reqs)
    for name in _TENSORS:
        assert torch.equal(getattr(info, name), getattr(ref, name)), name
    for name in _LISTS + _FLAGS:
        assert getattr(info, name) == getattr(ref, name), name
    # Penalizer state: same effect on logits of both signs (which penalizers are present
    # may differ: filter drops inactive ones, from_reqs builds every one a request names).
    g = torch.Generator().manual_seed(len(reqs))
    logits = torch.randn(len(reqs), V, generator=g) * 3
    logits[:, 0] = float("-inf")
    a, b = logits.clone(), logits.clone()
    info.apply_logits_bias(a)
    ref.apply_logits_bias(b)
    assert torch.equal(a, b)
    assert torch.equal(Sampler()(a, info), Sampler()(b, ref))


@pytest.mark.parametrize("seed", range(12))
def test_filter_merge_cumulate_equal_from_reqs(seed):
    """Random scripts of the scheduler's operations; every step compared with from_reqs."""
    rnd = random.Random(seed)
    n = 0

    def fresh(k):
        nonlocal n
        out = []
        for _ in range(k):
            out.append(mk(rnd.randrange(len(PARAMS)), n))
            n += 1
        return out

    reqs = fresh(rnd.randint(1, 4))
    info = from_reqs(reqs)
    assert_same(info, reqs)
    for _ in range(10):
        op = rnd.choice(["step", "step", "filter", "merge"])
        if op == "step":
            toks = [rnd.randrange(V) for _ in reqs]
            info.cumulate_output_tokens(torch.tensor(toks, dtype=torch.int64))
            for r, t in zip(reqs, toks):
                r.output_ids.append(t)
        elif op == "filter" and len(reqs) > 1:
            keep = sorted(rnd.sample(range(len(reqs)), rnd.randint(1, len(reqs) - 1)))
            if rnd.random() < 0.3:
                rnd.shuffle(keep)
            info.filter_batch(keep)
            reqs = [reqs[i] for i in keep]
        else:
            new = fresh(rnd.randint(1, 3))
            other = from_reqs(new)
            if len(new) > 1 and rnd.random() < 0.5:  # prefilled rows that finished at once
                other.filter_batch([len(new) - 1])
                new = new[-1:]
            info.merge_batch(other)
            reqs = reqs + new
        assert_same(info, reqs)


def test_derived_flags_follow_filter_and_merge():
    greedy = from_reqs([mk(0, 0), mk(4, 1)])  # greedy rows ignore their top_k
    assert (greedy.is_all_greedy, greedy.has_greedy, greedy.need_top_k) == (True, True, False)
    assert greedy.penalizer_orchestrator.is_required
    greedy.merge_batch(from_reqs([mk(2, 2), mk(3, 3)]))
    assert (greedy.is_all_greedy, greedy.need_top_k, greedy.need_top_p, greedy.need_min_p) == \
        (False, True, True, True)
    greedy.vocab_mask = torch.zeros(4, 1, dtype=torch.int32)
    greedy.filter_batch([3, 2])
    assert greedy.vocab_mask is None
    assert (greedy.has_greedy, greedy.need_top_k, greedy.need_top_p) == (False, True, True)
    greedy.filter_batch([1])
    assert (greedy.is_all_greedy, greedy.need_top_k, greedy.need_top_p, greedy.need_min_p) == \
        (False, True, False, False)
    assert not greedy.penalizer_orchestrator.is_required and greedy.positions == [2]


# ---- neither a processor nor a bias lifts the mask, on every CPU bitmask path ----------------
BIG_V = 49157  # SmolLM2-sized, plus a partial last mask word


def _random_words(n: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2**32, (n,), generator=g) - 2**31).to(torch.int32)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
def test_processor_and_bias_cannot_lift_the_mask_on_any_cpu_path(contiguous, native, monkeypatch):
    """Rows built for apply_token_bitmask_inplace's CPU paths: 0 allows a few words (saved,
    filled, restored), 1 is dense (tiles), 2 is nearly all allowed (xgrammar's C loop for a
    contiguous mask, else the sparse index fill), 3 allows everything; with ``native`` the
    C++ op takes a contiguous mask whole (constrained/bitmask_cpu.cpp). On each, a processor
    boosts forbidden tokens to +1e4 and the bias adds +100 to others: all stay -inf."""
    paths = []
    if native:
        from srt.layers.cpu_kernels import load_cpu_kernels

        if not load_cpu_kernels():
            pytest.skip("gramsync's CPU kernels are not built here")
        op = bitmask_ops._native_op()
        monkeypatch.setattr(bitmask_ops, "_native_op", lambda: lambda *a: paths.append("native") or op(*a))
    else:
        monkeypatch.setattr(bitmask_ops, "_native_op", lambda: None)
    g = torch.Generator().manual_seed(0)
    words = (BIG_V + 31) // 32
    buf = torch.full((4, words + 3), -1, dtype=torch.int32)
    mask = buf[:, :words]  # a column slice: not contiguous
    mask[0] = 0
    mask[0, torch.randperm(words, generator=g)[:20]] = _random_words(20, g)
    mask[1] = _random_words(words, g)
    mask[2, torch.randperm(words, generator=g)[:30]] = _random_words(30, g)
    if contiguous:
        mask = mask.contiguous()
    allowed = unpack_bitmask(mask, BIG_V)
    reqs, boosted, biased = [], [], []
    for i in range(4):
        pool = (~allowed[i]).nonzero().squeeze(1) if i < 3 else torch.arange(BIG_V)
        pick = pool[torch.randperm(len(pool), generator=g)[:8]].tolist()
        boosted.append(pick[:4])
        biased.append(tuple((t, 100.0) for t in pick[4:]))
        reqs.append(Req(f"m{i}", (1,), SamplingParams(
            temperature=0, logit_bias=biased[-1], custom_logit_processor=BoostTokens.to_str(),
            custom_params={"token_ids": boosted[-1]}), False, frozenset({0})))
    info = SamplingBatchInfo.from_reqs(reqs, BIG_V, "cpu", torch.Generator().manual_seed(0))
    info.vocab_mask = mask
    logits = torch.randn(4, BIG_V, generator=g)
    for i in range(3):  # whatever a forbidden logit held, it ends -inf
        logits[i, biased[i][0][0]] = float("nan")
        logits[i, biased[i][1][0]] = float("inf")
    want = logits.clone()
    for i in range(4):
        want[i, boosted[i]] = 1e4
    want.masked_fill_(~allowed, float("-inf"))
    for i in range(4):
        for t, b in biased[i]:
            want[i, t] += b
    paths.clear()  # which CPU paths ran: the premise of this test
    for name in ("_apply_few_allowed", "_apply_tiles", "_apply_sparse"):
        fn = getattr(bitmask_ops, name)
        monkeypatch.setattr(bitmask_ops, name, lambda *a, _f=fn, _n=name: paths.append(_n) or _f(*a))
    c_loop = xgrammar.apply_token_bitmask_inplace
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace",
                        lambda *a, **k: paths.append("xgrammar") or c_loop(*a, **k))
    info.apply_logits_bias(logits)
    if native and contiguous:
        assert paths == ["native"], paths
    else:
        assert {"_apply_few_allowed", "_apply_tiles",
                "xgrammar" if contiguous else "_apply_sparse"} <= set(paths), paths
    assert torch.equal(logits, want)
    assert (logits[~allowed] == float("-inf")).all() and (logits[3, boosted[3]] == 1e4).all()
    ids = Sampler()(logits, info)
    assert allowed[torch.arange(4), ids].all() and ids[3].item() in boosted[3]


# ---- the real scheduler --------------------------------------------------------------------
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Hello",
           "Write a haiku about the sea."]
# rid -> (prompt, params): greedy and seeded sampled requests (unseeded ones depend on the
# batch by design), all with some penalty or bias, lengths 3..6 so the batch keeps changing.
MIXED = {
    "a": (0, dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, max_new_tokens=6)),
    "b": (1, dict(temperature=0.9, top_p=0.9, seed=11, frequency_penalty=1.0, max_new_tokens=3)),
    "c": (2, dict(temperature=1.0, top_k=20, seed=12, presence_penalty=1.0, max_new_tokens=5,
                  logit_bias=((28, 2.0), (29, 3.0)))),
    "d": (3, dict(temperature=0, presence_penalty=0.5, logit_bias=((28, 4.0),), max_new_tokens=4)),
    "e": (4, dict(temperature=0.8, min_p=0.05, seed=13, repetition_penalty=1.5, min_new_tokens=3,
                  max_new_tokens=4)),
}
ARRIVALS = {0: ["a", "b"], 2: ["c"], 3: ["d", "e"]}


def make_scheduler(model_dir, tok, **kw) -> Scheduler:
    """As in test_scheduler.py: fp32 so batched and solo runs can be compared exactly."""
    args = ServerArgs(model_path=model_dir, random_seed=0, dtype="float32", **kw)
    return Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(model_dir, None), tok)


def run(s: Scheduler, arrivals: dict[int, list[TokenizedGenerateReq]]) -> dict[str, list[int]]:
    """Step until idle, feeding ``arrivals[step]`` before that step; rid -> output ids."""
    outs: dict[str, list[int]] = {}
    step = 0
    while s.has_work() or step <= max(arrivals):
        s.process_input_requests(arrivals.get(step, []))
        for batch in s.step():
            for rid, ids in zip(batch.rids, batch.new_token_ids):
                outs.setdefault(rid, []).extend(ids)
        step += 1
        assert step < 200, "scheduler did not finish"
    s.kv.check_idle_integrity()
    return outs


def msg(tok, rid) -> TokenizedGenerateReq:
    prompt, params = MIXED[rid]
    ids = tuple(tok(PROMPTS[prompt])["input_ids"])
    return TokenizedGenerateReq(rid, ids, SamplingParams(ignore_eos=(rid != "e"), **params))


@pytest.fixture(scope="module")
def solo(tiny_dir, smollm2_tokenizer):
    """(scheduler, rid -> output ids of the request run alone): a fresh scheduler that
    runs one request at a time; the mixed test then reuses it."""
    s = make_scheduler(tiny_dir, smollm2_tokenizer, max_total_tokens=512, max_running_requests=8)
    return s, {rid: run(s, {0: [msg(smollm2_tokenizer, rid)]})[rid] for rid in MIXED}


def test_changing_batch_gives_solo_outputs(solo, smollm2_tokenizer):
    s, alone = solo
    sizes = []
    orig = s.runner.sample
    s.runner.sample = lambda logits, info, rows=(), **kw: sizes.append(len(info)) or orig(logits, info, rows, **kw)
    try:
        outs = run(s, {k: [msg(smollm2_tokenizer, r) for r in v] for k, v in ARRIVALS.items()})
    finally:
        s.runner.sample = orig
    assert s.running_info is None and not s.running
    assert len(set(sizes)) >= 3, sizes  # the batch really lost and gained rows
    for rid, want in alone.items():
        params = MIXED[rid][1]
        assert params.get("min_new_tokens", 0) <= len(want) <= params["max_new_tokens"]
        assert rid == "e" or len(want) == params["max_new_tokens"]
        assert outs[rid] == want, rid


def test_retracted_request_resumes_with_same_penalized_output(solo, tiny_dir, smollm2_tokenizer,
                                                                monkeypatch):
    """A pool just big enough for both prompts + 4 tokens: the newer request ("c", seeded,
    presence penalty and bias) is retracted, resumed by re-prefilling prompt + output, and
    must rebuild its penalizer state and seeded position from that output."""
    _, alone = solo
    tok = smollm2_tokenizer
    monkeypatch.setenv("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "1")  # admit optimistically
    first, second = msg(tok, "a"), msg(tok, "c")
    pool = len(first.input_ids) + len(second.input_ids) + 4
    s = make_scheduler(tiny_dir, tok, max_total_tokens=pool, max_running_requests=4)
    retracted = []
    ensure = s._ensure_decode_capacity

    def spy():
        before = s.num_retractions
        ensure()
        if s.num_retractions > before:
            retracted.extend((r.rid, len(r.output_ids)) for r in s.waiting)

    s._ensure_decode_capacity = spy
    outs = run(s, {0: [first, second]})
    assert retracted and retracted[0][0] == "c" and retracted[0][1] > 0, retracted
    assert outs["a"] == alone["a"]
    assert outs["c"] == alone["c"]
