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
