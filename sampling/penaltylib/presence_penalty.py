"""Presence penalty (OpenAI): subtract ``penalty`` once for every token that already
occurs in the output, however often."""
from __future__ import annotations

import torch

from sampling.penaltylib.base import RowTensorPenalizer, output_counts, row_values
from sampling.sampling_params import SamplingParams


class BatchedPresencePenalizer(RowTensorPenalizer):
    ROW_FIELDS = ("penalties", "present")

    def __init__(self, penalties: torch.Tensor, present: torch.Tensor):
        self.penalties = penalties  # [B, 1]
        self.present = present  # [B, V] float32, 1.0 where the token occurred in the output

    @staticmethod
    def is_required(params: SamplingParams) -> bool:
        return params.presence_penalty != 0.0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        present = (output_counts(reqs, vocab_size, device) > 0).float()
        return cls(row_values(reqs, "presence_penalty", device), present)

    def is_active(self) -> bool:
        return bool((self.penalties != 0).any())

    def cumulate_output_tokens(self, output_ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.present[rows, output_ids] = 1.0

    def apply(self, logits: torch.Tensor) -> None:
        logits.addcmul_(self.present, self.penalties, value=-1.0)
