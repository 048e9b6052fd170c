"""penaltylib against hand-computed logits (V=8, literal expected values), the orchestrator's
build / filter / merge, the order of the penalties and of SamplingBatchInfo's logits
pipeline (penalties -> grammar vocab mask -> logit bias -> custom processors)."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from constrained.bitmask_ops import allocate_token_bitmask
from sampling.custom_logit_processor import CustomLogitProcessor
from sampling.penaltylib import PENALIZER_ORDER, BatchedPenalizerOrchestrator
from sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer
from sampling.sampler import Sampler
from sampling.sampling_batch_info import SamplingBatchInfo
from sampling.sampling_params import SamplingParams
from srt.scheduler.req import Req

V, EOS = 8, 7
INF = float("inf")
BASE = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def mk(prompt=(0,), out=(), rid="r", **params) -> Req:
    r = Req(rid, tuple(prompt), SamplingParams(**params), False, frozenset({EOS}))
    r.output_ids = list(out)
    return r


def orch(*reqs) -> BatchedPenalizerOrchestrator:
    return BatchedPenalizerOrchestrator.build(list(reqs), V, torch.device("cpu"))


def applied(o: BatchedPenalizerOrchestrator, rows) -> list[list[float]]:
    x = torch.tensor(rows, dtype=torch.float32)
    o.apply(x)
    return x.tolist()


def step(o, *toks) -> None:
    o.cumulate_output_tokens(torch.tensor(toks, dtype=torch.int64))


def test_frequency_counts_output_only_per_row():
    o = orch(mk(prompt=(1, 2), out=(3, 3, 4), frequency_penalty=0.5),
             mk(prompt=(5,), out=(2,), frequency_penalty=-1.0))
    assert applied(o, [BASE, BASE]) == [[0, 1, 2, 2, 3.5, 5, 6, 7], [0, 1, 3, 3, 4, 5, 6, 7]]
    step(o, 3, 2)
    step(o, 5, 6)
    assert applied(o, [BASE, BASE]) == [[0, 1, 2, 1.5, 3.5, 4.5, 6, 7], [0, 1, 4, 3, 4, 5, 7, 7]]


def test_presence_subtracts_once():
    o = orch(mk(prompt=(1, 2), out=(3, 3, 4), presence_penalty=0.5))
    assert applied(o, [BASE]) == [[0, 1, 2, 2.5, 3.5, 5, 6, 7]]
    step(o, 3)
    step(o, 6)
    assert applied(o, [BASE]) == [[0, 1, 2, 2.5, 3.5, 5, 5.5, 7]]


def test_repetition_divides_positive_multiplies_negative_prompt_and_output():
    logits = [-2.0, 4.0, -4.0, 6.0, 8.0, 1.0, -1.0, 0.0]
    o = orch(mk(prompt=(1, 2, 7), out=(3,), repetition_penalty=2.0),
             mk(prompt=(4,), out=(6,), repetition_penalty=0.5))
    assert applied(o, [logits, logits]) == [[-2, 2, -8, 3, 8, 1, -1, 0],
                                            [-2, 4, -4, 6, 16, 1, -0.5, 0]]
    step(o, 0, 5)
    assert applied(o, [logits, logits]) == [[-4, 2, -8, 3, 8, 1, -1, 0],
                                            [-2, 4, -4, 6, 16, 2, -0.5, 0]]


def test_min_new_tokens_masks_stop_ids_until_reached():
    o = orch(mk(out=(), min_new_tokens=2, max_new_tokens=5, stop_token_ids=(5,)),
             mk(out=(), min_new_tokens=3, max_new_tokens=5, stop_token_ids=(2,), ignore_eos=True),
             mk(out=(1, 1), min_new_tokens=2, max_new_tokens=5))  # resumed: already satisfied
    masked = [0, 1, 2, 3, 4, -INF, 6, -INF]
    no_eos = [0, 1, -INF, 3, 4, 5, 6, 7]
    assert applied(o, [BASE] * 3) == [masked, no_eos, BASE]
    step(o, 1, 1, 1)
    assert applied(o, [BASE] * 3) == [masked, no_eos, BASE]
    step(o, 1, 1, 1)  # row 0 has 2 tokens now: untouched; row 1 has 2 < 3
    assert applied(o, [BASE] * 3) == [BASE, no_eos, BASE]
    step(o, 1, 1, 1)
    assert applied(o, [BASE] * 3) == [BASE, BASE, BASE]


def test_only_needed_penalizers_are_built():
    assert orch(mk(), mk(temperature=0.5, logit_bias=((1, 2.0),))).penalizers == {}
    assert not orch(mk()).is_required
    assert set(orch(mk(frequency_penalty=0.1)).penalizers) == {BatchedFrequencyPenalizer}
    o = orch(mk(presence_penalty=0.1), mk(repetition_penalty=1.1), mk(min_new_tokens=1))
    assert set(o.penalizers) == {BatchedPresencePenalizer, BatchedRepetitionPenalizer,
                                 BatchedMinNewTokensPenalizer}


def test_filter_drops_penalizers_no_row_needs():
    o = orch(mk(frequency_penalty=1.0, out=(1,)), mk(presence_penalty=1.0, out=(2,)),
             mk(min_new_tokens=1, max_new_tokens=3))
    o.filter(torch.tensor([2, 1]))
    assert set(o.penalizers) == {BatchedPresencePenalizer, BatchedMinNewTokensPenalizer}
    assert applied(o, [BASE, BASE]) == [[0, 1, 2, 3, 4, 5, 6, -INF], [0, 1, 1, 3, 4, 5, 6, 7]]
    step(o, 3, 3)  # min_new_tokens reached: the next filter drops it
    o.filter(torch.tensor([0, 1]))
    assert set(o.penalizers) == {BatchedPresencePenalizer}
    assert applied(o, [BASE, BASE]) == [BASE, [0, 1, 1, 2, 4, 5, 6, 7]]


@pytest.mark.parametrize("penalized_first", [True, False])
def test_merge_gives_neutral_rows_to_the_side_without(penalized_first):
    pen = orch(mk(prompt=(1,), out=(3,), frequency_penalty=1.0, min_new_tokens=2))
    plain = orch(mk(prompt=(1, 2), out=(3, 4)), mk(prompt=(5,), out=(5,), temperature=0))
    a, b = (pen, plain) if penalized_first else (plain, pen)
    a.merge(b)
    assert a.batch_size == 3
    assert set(a.penalizers) == {BatchedFrequencyPenalizer, BatchedMinNewTokensPenalizer}
    rows = {"pen": [0, 1, 2, 2, 4, 5, 6, -INF], "plain0": BASE, "plain1": BASE}
    order = ["pen", "plain0", "plain1"] if penalized_first else ["plain0", "plain1", "pen"]
    assert applied(a, [BASE] * 3) == [rows[k] for k in order]
    step(a, *[3] * 3)  # the neutral rows stay neutral after cumulating tokens too
    rows["pen"] = [0, 1, 2, 1, 4, 5, 6, 7]
    assert applied(a, [BASE] * 3) == [rows[k] for k in order]


def test_penalty_order_repetition_then_frequency_presence_then_min_new():
    assert PENALIZER_ORDER == (BatchedRepetitionPenalizer, BatchedFrequencyPenalizer,
                               BatchedPresencePenalizer, BatchedMinNewTokensPenalizer)
    o = orch(mk(prompt=(0,), out=(3, 3, 4), repetition_penalty=2.0, frequency_penalty=1.0,
                presence_penalty=0.5, min_new_tokens=5, max_new_tokens=8))
    logits = [4.0, 1.0, 2.0, 4.0, -1.0, 5.0, 6.0, 7.0]
    # token 3: 4/2 - 2*1 - 0.5 = -0.5 (frequency first would give (4-2-0.5)/2 = 0.75)
    # token 4: -1*2 - 1 - 0.5 = -3.5 (frequency first: (-1-1-0.5)*2 = -5); token 0 from prompt
    assert applied(o, [logits]) == [[2.0, 1, 2, -0.5, -3.5, 5, 6, -INF]]


def test_penalties_keep_minus_inf_and_make_no_nan():
    o = orch(mk(prompt=(0, 1), out=(1, 2, 3), repetition_penalty=2.0, frequency_penalty=-2.0,
                presence_penalty=-2.0),
             mk(prompt=(0, 1), out=(1, 2, 3), repetition_penalty=0.5, frequency_penalty=2.0,
                presence_penalty=2.0, min_new_tokens=1))
    logits = [-INF, -INF, -INF, -INF, 1.0, 2.0, 3.0, -INF]
    out = applied(o, [logits, logits])
    assert out == [logits, logits]
    assert not torch.tensor(out).isnan().any()


# ---- SamplingBatchInfo.apply_logits_bias: penalties -> custom -> vocab mask -> bias ---------
class Recorder(CustomLogitProcessor):
    """Records the logits it is given (to see what ran before it); changes nothing."""

    seen: list = []

    def __call__(self, logits, custom_param_list: list[Optional[dict]]):
        Recorder.seen.append(logits.clone())
        return logits


def info_for(*reqs) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(list(reqs), V, "cpu", torch.Generator().manual_seed(0))


def pipeline(info, rows) -> tuple[list[list[float]], list[int]]:
    x = torch.tensor(rows, dtype=torch.float32)
    info.apply_logits_bias(x)
    return x.tolist(), Sampler()(x.clone(), info).tolist()


def test_bias_cannot_lift_a_grammar_masked_token():
    info = info_for(mk(temperature=0, logit_bias=((3, 100.0), (5, 1.5))))
    info.vocab_mask = allocate_token_bitmask(1, V)
    info.vocab_mask[0, 0] &= ~(1 << 3)
    logits, ids = pipeline(info, [BASE])
    assert logits == [[0, 1, 2, -INF, 4, 6.5, 6, 7]] and ids == [7]
    info.vocab_mask = None  # without the mask the +100 wins: the test above can fail
    assert pipeline(info, [BASE])[1] == [3]


def test_penalty_before_bias():
    info = info_for(mk(prompt=(3,), temperature=0, repetition_penalty=2.0, logit_bias=((3, -5.0),)))
    logits = [0.0, 1.0, 2.0, 6.0, 4.0, 2.5, -3.0, 0.5]
    out, ids = pipeline(info, [logits])
    assert out == [[0, 1, 2, -2.0, 4, 2.5, -3, 0.5]]  # 6/2 - 5, not (6-5)/2
    assert ids == [4]


def test_min_new_tokens_mask_survives_positive_bias():
    info = info_for(mk(prompt=(1,), temperature=0, min_new_tokens=2, max_new_tokens=4,
                       logit_bias=((EOS, 100.0),)))
    out, ids = pipeline(info, [BASE])
    assert out == [[0, 1, 2, 3, 4, 5, 6, -INF]] and ids == [6]
    info.cumulate_output_tokens(torch.tensor([6]))
    info.cumulate_output_tokens(torch.tensor([6]))  # 2 tokens produced: bias applies again
    out, ids = pipeline(info, [BASE])
    assert out == [[0, 1, 2, 3, 4, 5, 6, 107]] and ids == [EOS]


def test_custom_processor_runs_before_mask_and_bias_and_sampling_follows():
    rec = Recorder.to_str()
    info = info_for(mk(prompt=(5,), out=(5,), temperature=0, frequency_penalty=2.0,
                       logit_bias=((2, 3.0),), custom_logit_processor=rec),
                    mk(prompt=(6,), temperature=0.5, top_k=2, seed=11, repetition_penalty=2.0))
    info.vocab_mask = allocate_token_bitmask(2, V)
    info.vocab_mask[:, 0] &= ~(1 << 7)
    Recorder.seen.clear()
    out, ids = pipeline(info, [BASE, BASE])
    first = [0, 1, 5, 3, 4, 3, 6, -INF]
    assert out == [first, [0, 1, 2, 3, 4, 5, 3, -INF]]
    # It saw the penalty only: the mask (token 7) and the bias (token 2) come after it.
    assert [t.tolist() for t in Recorder.seen] == [[[0, 1, 2, 3, 4, 3, 6, 7]]]
    assert ids[0] == 6 and ids[1] in (4, 5)  # top-2 of the penalized, masked row
