"""Repetition penalty (CTRL paper; transformers' and SGLang's definition): for every token
seen in the prompt or the output, divide a positive logit by ``penalty`` and multiply a
negative one by it, so penalty > 1 always makes a seen token less likely."""
from __future__ import annotations

import torch

from sampling.penaltylib.base import RowTensorPenalizer, row_values
from sampling.sampling_params import SamplingParams


class BatchedRepetitionPenalizer(RowTensorPenalizer):
    ROW_FIELDS = ("penalties", "seen")

    def __init__(self, penalties: torch.Tensor, seen: torch.Tensor):
        self.penalties = penalties  # [B, 1], 1.0 = neutral
        self.seen = seen  # [B, V] bool: token occurs in prompt or output

    @staticmethod
    def is_required(params: SamplingParams) -> bool:
        return params.repetition_penalty != 1.0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        seen = torch.zeros((len(reqs), vocab_size), dtype=torch.bool, device=device)
        for i, r in enumerate(reqs):
            ids = [t for t in r.origin_input_ids + r.output_ids if 0 <= t < vocab_size]
            if ids:
                seen[i, torch.tensor(ids, dtype=torch.int64, device=device)] = True
        return cls(row_values(reqs, "repetition_penalty", device), seen)

    def is_active(self) -> bool:
        return bool((self.penalties != 1.0).any())

    def cumulate_output_tokens(self, output_ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.seen[rows, output_ids] = True

    def apply(self, logits: torch.Tensor) -> None:
        scaled = torch.where(logits > 0, logits / self.penalties, logits * self.penalties)
        torch.where(self.seen, scaled, logits, out=logits)
