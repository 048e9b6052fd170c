"""Speculative decoding's parts, one at a time: the n-gram index, draft sizing, the draft's
walk through a real grammar (xgrammar, llguidance over SmolLM2's tokenizer), the
verification rows' sampling state, and the exactness of accepting a draft while the
sample equals it (chi-square against the exact float64 distribution)."""
from __future__ import annotations

import json

import pytest
import torch

from constrained.grammar_config import GrammarBackendConfig
from constrained.llguidance_backend import GuidanceBackend
from constrained.xgrammar_backend import XGrammarGrammarBackend
from sampling.sampler import Sampler
from sampling.sampling_params import SamplingParams
from sampling.verify_batch import expand_for_verify, verify_rows
from srt.scheduler.req import Req
from srt.speculative.drafter import GrammarWalk, allowed
from srt.speculative.ngram import NgramIndex
from srt.speculative.draft_plan import DraftAsk, expected_end, plan_draft_lengths
from srt.speculative.spec_state import PROBE_EVERY, PROBE_TOKENS, SpecConfig, SpecState, best_draft_length
from srt.speculative import step_cost
from srt.speculative.step_cost import StepCostTable
from test_sampler_statistics import assert_fits, make_info, reference_probs

VOCAB = 49152
CFG = SpecConfig(num_draft_tokens=8, min_match=1, max_match=12, row_cost=0.12, max_rows=16)
BACKENDS = {"xgrammar": XGrammarGrammarBackend, "llguidance": GuidanceBackend}


# ---- the n-gram index -----------------------------------------------------------------
def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    idx = NgramIndex()
    idx.extend([1, 2, 3, 4, 5, 9, 3, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurred at 0..2 (followed by 4, 5); [3] alone more recently (-> 7)
    assert idx.propose(2, 1, 12) == [4, 5]
    assert idx.propose(2, 4, 12) == []  # no match of 4 tokens


def test_most_recent_of_equal_matches_and_k_limit():
    idx = NgramIndex()
    idx.extend([5, 6, 1, 5, 6, 2, 5, 6])
    assert idx.propose(1, 2, 12) == [2]
    assert idx.propose(5, 2, 12) == [2, 5, 6]  # stops at the sequence's end
    assert idx.propose(0, 1, 12) == []


def test_best_match_reports_length_and_position():
    idx = NgramIndex()
    idx.extend([1, 2, 3, 4, 1, 2, 3])
    assert idx.best_match(1, 12) == (3, 2)
    assert idx.best_match(4, 12) == (0, -1)
    assert idx.best_match(1, 2) == (2, 2)


def test_truncate_and_sync_keep_the_index_consistent():
    idx = NgramIndex()
    idx.extend([1, 2, 3, 1])
    idx.extend([2, 9])
    idx.truncate(4)
    assert idx.tokens == [1, 2, 3, 1] and idx.positions[2] == [1] and idx.positions[9] == []
    assert idx.propose(3, 1, 12) == [2, 3, 1]
    idx.sync([1, 2, 3, 1, 2])
    assert idx.propose(3, 2, 12) == [3, 1, 2]


# ---- sizing ---------------------------------------------------------------------------
def test_draft_length_follows_the_acceptance_rate():
    assert best_draft_length(0.95, 8, 0.12) == 8
    assert 1 <= best_draft_length(0.5, 8, 0.12) <= 3
    assert best_draft_length(0.05, 8, 0.12) == 0  # below the row cost: drafting is off


def _flat(c):
    return lambda rows: 1.0 + c * (rows - 1)


def test_the_plan_weighs_every_request_against_the_steps_cost():
    # a large batch: one more row costs more relative to each request's share
    assert plan_draft_lengths([DraftAsk(0.7, 8)] * 32, 32, 16, _flat(0.12)) == [0] * 32
    # the extra rows go to the surest drafts first, each request's a prefix
    lengths = plan_draft_lengths([DraftAsk(0.3, 8), DraftAsk(0.95, 8)], 2, 8, _flat(0.05))
    assert lengths[1] >= 4 and lengths[1] > lengths[0] and sum(lengths) <= 8
    # a batch-1 graph much faster than the next (a GGUF's codes at 1 row, dense at 2+):
    # a guess is not worth the jump, a near-certain copy is
    def jump(rows):
        return 12.0 if rows == 1 else 20.0 + 0.5 * rows
    assert plan_draft_lengths([DraftAsk(0.4, 8)], 1, 8, jump) == [0]
    assert plan_draft_lengths([DraftAsk(0.97, 8)], 1, 8, jump) == [8]
    assert plan_draft_lengths([DraftAsk(0.9, 8)], 1, 0, jump) == [0]  # no rows left


def test_a_closed_batch_drafts_only_where_its_end_comes_sooner():
    flat = _flat(0.12)
    # Nothing waiting, four requests of equal length: one sure copy ending early saves only
    # a row of the steps after it; the rows it rides on slow the other three.
    sure, guess = DraftAsk(0.9, 8, 100), DraftAsk(0.2, 8, 100)
    assert plan_draft_lengths([sure, guess, guess, guess], 4, 8, flat, closed_tail=0) == [0] * 4
    assert plan_draft_lengths([sure, guess, guess, guess], 4, 8, flat)[0] > 0  # requests wait
    # the request that ends last drafts (its gain brings the batch's end nearer) ...
    long_sure, short = DraftAsk(0.9, 8, 100), DraftAsk(0.9, 8, 20)
    lengths = plan_draft_lengths([long_sure, short], 2, 8, flat, closed_tail=0)
    assert lengths[0] > 0 and lengths[1] == 0
    # ... unless a request that does not draft ends later still
    assert plan_draft_lengths([long_sure, short], 3, 8, flat, closed_tail=150) == [0, 0]
    # all equally sure and equally long: every one drafts, or the end does not move
    lengths = plan_draft_lengths([DraftAsk(0.95, 8, 100)] * 4, 4, 8, flat, closed_tail=0)
    assert min(lengths) >= 1
    # the batch's end: one request's expected gain; tied requests only if all are kept
    assert expected_end([DraftAsk(0.5, 3, 10)], [3], 0) == pytest.approx(10 - 0.5 - 0.25 - 0.125)
    assert expected_end([DraftAsk(0.5, 1, 10)] * 2, [1, 1], 0) == pytest.approx(10 - 0.25)
    assert expected_end([DraftAsk(0.5, 1, 10)] * 2, [1, 0], 0) == 10
    assert expected_end([DraftAsk(0.9, 4, 10)], [4], 12) == 12  # a longer request does not draft
    # one request alone: the same plan as the step's throughput gives
    for rate in (0.2, 0.5, 0.9):
        assert (plan_draft_lengths([DraftAsk(rate, 8, 50)], 1, 8, flat, closed_tail=0)
                == plan_draft_lengths([DraftAsk(rate, 8, 50)], 1, 8, flat))


def test_the_cost_table_measures_and_estimates():
    t = StepCostTable(0.1, measure=True)
    assert t.cost(5) == pytest.approx(1.4)  # nothing measured: the flat model
    for s in (0.012, 0.013, 0.5, 0.012):  # one slow step moves nothing (median)
        t.observe(1, s)
    t.observe(9, 0.030)
    assert t.cost(1) == pytest.approx(0.0125)
    assert t.cost(5) == pytest.approx(0.0125 + (0.030 - 0.0125) * 4 / 8)  # between two measured
    assert t.cost(12) == pytest.approx(0.030 * t.flat(12) / t.flat(9))  # past them: flat, scaled
    t.observe(12, 0.020)  # noise put 12 rows below 9: never cheaper than 9 plus 3 flat rows
    assert t.cost(12) == pytest.approx(0.030 * t.flat(12) / t.flat(9))
    assert t.cost(10) >= t.cost(9) * t.flat(10) / t.flat(9) - 1e-12
    for _ in range(step_cost.MAX_AGE):  # 9 and 12 rows not measured for long: forgotten
        t.observe(1, 0.012)
    assert t.cost(12) == pytest.approx(0.012 * t.flat(12))
    t.reset()
    assert t.cost(1) == pytest.approx(1.0)
    off = StepCostTable(0.1, measure=False)  # more than one rank: nothing measured
    off.observe(1, 0.01)
    assert off.cost(2) == pytest.approx(1.1)


def _length(s: SpecState, limit: int, c: float, match: int) -> int:
    """One request alone under the flat model, through ask / planned as the scheduler does."""
    n = plan_draft_lengths([s.ask(limit, match)], 1, limit, _flat(c))[0]
    s.planned(n)
    return n


def test_failing_drafts_stop_then_probe_again_less_often():
    s = SpecState()
    assert _length(s, 8, 0.12, match=1) > 0  # the prior: a one-token match is tried
    for _ in range(12):
        s.record(drafted=4, accepted=0)
    assert s.rates[0] < 0.05 and s.verify_ct == 12
    lengths = [_length(s, 8, 0.12, match=1) for _ in range(PROBE_EVERY + 1)]
    assert lengths[:-1] == [0] * PROBE_EVERY and lengths[-1] == PROBE_TOKENS
    s.record(drafted=2, accepted=0)  # the probe failed: the next comes twice as late
    lengths = [_length(s, 8, 0.12, match=1) for _ in range(2 * PROBE_EVERY + 1)]
    assert lengths[:-1] == [0] * (2 * PROBE_EVERY) and lengths[-1] == PROBE_TOKENS
    assert _length(s, 8, 0.12, match=5) >= 2  # a long match keeps its own estimate
    for _ in range(6):
        s.record(drafted=4, accepted=4)
    assert s.rates[2] > 0.9 and _length(s, 8, 0.12, match=3) >= 4
    assert s.probe_every == PROBE_EVERY  # drafting on its own rate resets the wait


# ---- the walk through a grammar -------------------------------------------------------
SCHEMA = {"type": "object", "required": ["name", "city"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"}}}


def _grammar(backend, tokenizer):
    b = BACKENDS[backend].from_tokenizer(tokenizer, GrammarBackendConfig(VOCAB, (tokenizer.eos_token_id,)))
    try:
        return b.dispatch(("json_schema", json.dumps(SCHEMA)))
    finally:
        b.shutdown()


def _walk_req(grammar, tokenizer, prompt: str, output: str) -> Req:
    r = Req("w", tuple(tokenizer.encode(prompt)), SamplingParams(), False,
            frozenset({tokenizer.eos_token_id}))
    r.output_ids = tokenizer.encode(output)
    for t in r.output_ids:
        grammar.accept_token(t)
    r.grammar, r.spec = grammar, SpecState()
    r.spec.index.sync(r.fill_ids)
    return r


def _mask(grammar) -> torch.Tensor:
    m = grammar.allocate_vocab_mask(VOCAB, 1, "cpu")
    grammar.fill_vocab_mask(m, 0)
    return m[0].clone()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_walk_cuts_at_a_forbidden_token_and_leaves_the_grammar_as_it_was(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    g = _grammar(backend, tok)
    # The prompt repeats '"name": "Ada", "age' -- the schema has no "age": the draft must
    # stop before the key leaves the schema.
    r = _walk_req(g, tok, '{"name": "Ada", "age": 3}', '{"name": "')
    before = _mask(g)
    draft = GrammarWalk(r, 8, CFG, VOCAB, force=False).run()
    assert tok.decode(draft.tokens).startswith("Ada")
    assert "age" not in tok.decode(draft.tokens)
    assert torch.equal(_mask(g), before), "the walk must roll the grammar back"
    # Each mask row j allows the drafted token that follows it, and rows match a replay.
    assert draft.masks.shape[0] == len(draft.tokens)
    replay = _replayed(backend, tok, '{"name": "')
    for j, t in enumerate(draft.tokens):
        replay.accept_token(t)
        assert torch.equal(draft.masks[j], _mask(replay)), j
        if j + 1 < len(draft.tokens):
            assert allowed(draft.masks[j], draft.tokens[j + 1])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_forced_tokens_are_marked_and_the_row_after_them_is_not_sampled(backend, smollm2_tokenizer):
    tok = smollm2_tokenizer
    g = _grammar(backend, tok)
    r = _walk_req(g, tok, "nothing to copy here", '{"')
    draft = GrammarWalk(r, 3, CFG, VOCAB, force=True).run()
    # "name" is forced after '{"' (fast-forward's own test); the n-gram has nothing.
    assert draft.tokens and all(draft.forced)
    assert tok.decode(draft.tokens) in ("name", "nam", "na", "n") or tok.decode(draft.tokens).startswith("n")
    plain = GrammarWalk(r, 3, CFG, VOCAB, force=False).run()
    assert plain.tokens == []  # without fast-forward only the n-gram drafts
    assert torch.equal(_mask(g), _mask(_replayed(backend, tok, '{"')))


def _replayed(backend, tok, text):
    g = _grammar(backend, tok)
    for t in tok.encode(text):
        g.accept_token(t)
    return g


# ---- the verification rows ------------------------------------------------------------
def test_each_verify_row_counts_the_drafts_before_it():
    v = 64
    params = [SamplingParams.from_dict({"temperature": 0.7, "frequency_penalty": 0.5,
                                        "presence_penalty": 0.25, "repetition_penalty": 1.3,
                                        "logit_bias": {"3": 2.0}, "seed": 11}),
              SamplingParams.from_dict({"temperature": 0})]
    reqs = [Req(f"r{i}", (1, 2, 3), p, False, frozenset({0})) for i, p in enumerate(params)]
    for r in reqs:
        r.output_ids = [5, 6]
    from sampling.sampling_batch_info import SamplingBatchInfo
    info = SamplingBatchInfo.from_reqs(reqs, v, "cpu", torch.Generator())
    drafts = [[7, 7, 9], []]
    vinfo = expand_for_verify(info, drafts, [None, None])
    assert verify_rows(drafts) == ([0, 0, 0, 0, 1], [0, 1, 2, 3, 0])
    assert vinfo.positions == [2, 3, 4, 5, 2] and vinfo.seeds == [11] * 4 + [None]
    logits = torch.randn(5, v, generator=torch.Generator().manual_seed(0))
    got = logits.clone()
    vinfo.apply_logits_bias(got)
    for j in range(4):  # a plain batch whose request already produced drafts[:j]
        r = Req("x", (1, 2, 3), params[0], False, frozenset({0}))
        r.output_ids = [5, 6] + drafts[0][:j]
        plain = SamplingBatchInfo.from_reqs([r], v, "cpu", torch.Generator())
        want = logits[j:j + 1].clone()
        plain.apply_logits_bias(want)
        assert torch.allclose(got[j], want[0]), j
    assert info.positions == [2, 2], "the running batch's state is not touched"
    assert torch.allclose(got[4], logits[4])


def test_accepting_while_the_sample_equals_the_draft_is_exact():
    """Two positions, draft x at the first: the first token must follow p0 (the draft
    accepted with p0(x), else a residual sample), and after an accepted x the second must
    follow p1 -- the distributions of plain sampling."""
    torch.set_num_threads(1)
    v, n = 12, 40000
    g = torch.Generator().manual_seed(3)
    row0, row1 = torch.randn(v, generator=g) * 1.5, torch.randn(v, generator=g) * 1.5
    x = int(row0.argmax())
    params = SamplingParams(temperature=0.8, top_k=9)
    info = make_info([params] * n, v, gen_seed=5)
    vinfo = expand_for_verify(info, [[x]] * n, [None] * n)
    logits = torch.stack([row0, row1]).repeat(n, 1)
    ids = Sampler()(logits, vinfo).view(n, 2)
    first, second = ids[:, 0], ids[:, 1]
    q0 = reference_probs(row0, 0.8, 9)
    assert_fits(torch.bincount(first, minlength=v), q0)
    after_x = second[first == x]
    assert len(after_x) > 2000
    assert_fits(torch.bincount(after_x, minlength=v), reference_probs(row1, 0.8, 9))


def test_outlines_drafts_stay_within_its_rollback(smollm2_tokenizer):
    """outlines-core undoes at most 32 tokens: a long copy is drafted in under 32, and the
    walk leaves the guide where it was."""
    from constrained.outlines_backend import MAX_ROLLBACK, OutlinesGrammarBackend

    tok = smollm2_tokenizer
    b = OutlinesGrammarBackend.from_tokenizer(tok, GrammarBackendConfig(VOCAB, (tok.eos_token_id,)))
    try:
        g = b.dispatch(("regex", "[a-z ]+"))
    finally:
        b.shutdown()
    text = " ".join(["alpha beta gamma delta epsilon zeta eta theta iota kappa"] * 6)
    r = _walk_req(g, tok, text, "alpha beta")
    before = _mask(g)
    cfg = SpecConfig(num_draft_tokens=64, min_match=1, max_match=12, row_cost=0.12, max_rows=128)
    draft = GrammarWalk(r, 64, cfg, VOCAB, force=True).run()
    assert 20 <= len(draft.tokens) < MAX_ROLLBACK
    assert torch.equal(_mask(g), before)


def test_auto_speculation_is_on_where_verify_rows_compute_what_plain_steps_do():
    from srt.server_args import ServerArgs
    from srt.speculative.spec_state import auto_off_reason, spec_config_from_args

    f32, bf16 = torch.float32, torch.bfloat16
    auto = ServerArgs(model_path="m")
    assert auto.speculative_algorithm == "auto"  # the default
    assert spec_config_from_args(auto, "cpu", int4_codes=False, dtype=f32) is not None
    assert auto_off_reason(auto, "cpu", int4_codes=False, dtype=f32) is None
    # a GGUF's 4-bit codes at one row, dense weights in verify rows: other numerics
    assert spec_config_from_args(auto, "cpu", int4_codes=True, dtype=f32) is None
    assert "4-bit codes" in auto_off_reason(auto, "cpu", int4_codes=True, dtype=f32)
    # bf16: a verify step's rows round differently (bench_spec saw greedy outputs change)
    assert spec_config_from_args(auto, "cpu", int4_codes=False, dtype=bf16) is None
    assert "runs in bfloat16" in auto_off_reason(auto, "cpu", int4_codes=False, dtype=bf16)
    assert spec_config_from_args(ServerArgs(model_path="m", pp_size=2), "cpu", False, f32) is None
    assert spec_config_from_args(auto, "cuda:0", int4_codes=False, dtype=f32) is None  # not measured
    for off in ("none", None):
        assert spec_config_from_args(ServerArgs(model_path="m", speculative_algorithm=off), "cpu", False, f32) is None
    forced = ServerArgs(model_path="m", speculative_algorithm="NGRAM")
    assert spec_config_from_args(forced, "cpu", int4_codes=False, dtype=f32).num_draft_tokens == 8
    assert spec_config_from_args(forced, "cpu", int4_codes=False, dtype=bf16) is not None  # asked for: served
    with pytest.raises(ValueError, match="not supported with --pp-size"):
        ServerArgs(model_path="m", speculative_algorithm="NGRAM", pp_size=2)
