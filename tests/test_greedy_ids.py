"""The greedy fast path (sampling/greedy.py) gives torch.argmax's ids, ties included."""
from __future__ import annotations

import pytest
import torch

from sampling.greedy import BLOCK, MIN_ROWS, greedy_ids
from sampling.sampler import Sampler


@pytest.mark.parametrize("vocab", [49152, 151936, 4 * BLOCK + 7, 300])
@pytest.mark.parametrize("rows", [0, 1, 4, 5, 16])
def test_equals_torch_argmax_with_ties_and_any_vocab(vocab, rows):
    g = torch.Generator().manual_seed(vocab + rows)
    for logits in (torch.randn(rows, vocab, generator=g),
                   torch.randint(0, 3, (rows, vocab), generator=g).float(),  # ties everywhere
                   torch.full((rows, vocab), -3.0)):  # one value: index 0
        assert torch.equal(greedy_ids(logits), torch.argmax(logits, dim=-1))


def test_the_two_level_path_is_taken_from_min_rows(monkeypatch):
    """From MIN_ROWS rows on CPU the blocks decide (torch.argmax is not called)."""
    import sampling.greedy as greedy

    logits = torch.randn(MIN_ROWS, 49152)
    want = torch.argmax(logits, dim=-1)
    monkeypatch.setattr(greedy.torch, "argmax", None)  # any call would raise
    assert torch.equal(greedy.greedy_ids(logits), want)


def test_max_in_the_short_last_block_and_at_block_edges():
    vocab = 5 * BLOCK + 10
    for col in (0, BLOCK - 1, BLOCK, 5 * BLOCK - 1, 5 * BLOCK, vocab - 1):
        logits = torch.zeros(4, vocab)  # MIN_ROWS rows: the two-level path
        logits[0, col] = 1.0
        logits[1, col] = logits[1, max(col - 1, 0)] = 2.0  # a tie: the first one wins
        logits[2:, vocab - 1 - col] = 3.0
        assert torch.equal(greedy_ids(logits), torch.argmax(logits, dim=-1)), col


def test_sanitized_rows_match_torch_argmax():
    """Rows with NaN, +inf or nothing but -inf, after the Sampler's sanitize (as it always
    runs before the greedy path)."""
    logits = torch.randn(MIN_ROWS, 49152)
    logits[0, 7] = float("nan")
    logits[1, 123] = float("inf")
    logits[2] = float("-inf")
    logits[3, 40000] = float("nan")
    logits[3, 41000] = float("inf")
    Sampler().sanitize(logits)
    assert torch.equal(greedy_ids(logits), torch.argmax(logits, dim=-1))
    assert greedy_ids(logits)[1].item() == 123


@pytest.fixture(scope="module")
def native():
    from srt.layers.cpu_kernels import load_cpu_kernels

    if not load_cpu_kernels():
        pytest.skip("gramsync's CPU kernels are not built here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 4 * BLOCK + 7, 300, 17, 1])
def test_the_cpu_op_equals_torch_argmax_and_flags_non_finite_rows(native, dtype, vocab):
    """sampling/greedy_cpu.cpp: torch.argmax's ids (ties: the first) for finite rows, in
    fp32 and bf16 and on row views; a row with a NaN or +inf, or only -inf, is flagged, and
    native_greedy then leaves the batch to the Sampler's sanitizing path."""
    from sampling.greedy import native_greedy

    g = torch.Generator().manual_seed(vocab)
    for rows in (1, 3, 16):
        for logits in (torch.randn(rows, vocab, generator=g).to(dtype),
                       torch.randint(0, 3, (rows, vocab), generator=g).to(dtype),  # ties everywhere
                       torch.full((rows, vocab), -3.0, dtype=dtype)):
            ids, finite = torch.ops.gramsync.greedy_argmax(logits)
            assert torch.equal(ids, torch.argmax(logits.float(), dim=-1)) and bool(finite.all())
            assert torch.equal(native_greedy(logits), ids) if rows < MIN_ROWS else native_greedy(logits) is None
    wide = torch.randn(2, vocab + 5, generator=g).to(dtype)
    assert torch.equal(native_greedy(wide[:, 2:vocab + 2]), torch.argmax(wide[:, 2:vocab + 2].float(), dim=-1))
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(3, vocab, generator=g).to(dtype)
        logits[1, vocab // 2] = bad
        _, finite = torch.ops.gramsync.greedy_argmax(logits)
        assert finite.tolist() == [True, False, True]
        assert native_greedy(logits) is None
    assert not torch.ops.gramsync.greedy_argmax(torch.full((1, vocab), float("-inf"), dtype=dtype))[1].item()


def test_the_sampler_takes_the_op_only_for_all_finite_greedy_batches(native):
    """A greedy batch with a NaN row still gets sanitized ids, as without the op."""
    from sampling.sampling_batch_info import SamplingBatchInfo
    from sampling.sampling_params import SamplingParams
    from srt.scheduler.req import Req

    reqs = [Req(str(i), (1, 2), SamplingParams.from_dict({"temperature": 0}), False, frozenset()) for i in range(3)]
    info = SamplingBatchInfo.from_reqs(reqs, 49152, "cpu", torch.Generator().manual_seed(0))
    assert info.is_all_greedy
    logits = torch.randn(3, 49152)
    want = torch.argmax(logits, dim=-1)
    assert torch.equal(Sampler()(logits.clone(), info), want)
    logits[1, 9] = float("nan")
    fixed = logits.clone()
    Sampler().sanitize(fixed)
    assert torch.equal(Sampler()(logits, info), torch.argmax(fixed, dim=-1))
