"""Frequency penalty (OpenAI): subtract ``penalty * count`` for every token already in the
output, so the more often a token was produced the less likely it becomes."""
from __future__ import annotations

import torch

from sampling.penaltylib.base import RowTensorPenalizer, output_counts, row_values
from sampling.sampling_params import SamplingParams


class BatchedFrequencyPenalizer(RowTensorPenalizer):
    ROW_FIELDS = ("penalties", "counts")

    def __init__(self, penalties: torch.Tensor, counts: torch.Tensor):
        self.penalties = penalties  # [B, 1]
        self.counts = counts  # [B, V] float32 output-token counts

    @staticmethod
    def is_required(params: SamplingParams) -> bool:
        return params.frequency_penalty != 0.0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        return cls(row_values(reqs, "frequency_penalty", device),
                   output_counts(reqs, vocab_size, device))

    def is_active(self) -> bool:
        return bool((self.penalties != 0).any())

    def cumulate_output_tokens(self, output_ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.counts.index_put_((rows, output_ids), torch.ones_like(output_ids, dtype=torch.float32),
                               accumulate=True)

    def apply(self, logits: torch.Tensor) -> None:
        logits.addcmul_(self.counts, self.penalties, value=-1.0)
