"""min_new_tokens: until a request has produced that many tokens, the tokens that would
end it (its stop_token_ids and EOS, i.e. ``Req.stop_ids``) are set to -inf, so it cannot
stop early through them (stop strings are held back by ``Req.check_finished``)."""
from __future__ import annotations

import torch

from sampling.penaltylib.base import BatchedPenalizer
from sampling.sampling_params import SamplingParams


class BatchedMinNewTokensPenalizer(BatchedPenalizer):
    def __init__(self, min_new: list[int], out_len: list[int], stop_ids: list[tuple[int, ...]]):
        self.min_new = min_new
        self.out_len = out_len
        self.stop_ids = stop_ids

    @staticmethod
    def is_required(params: SamplingParams) -> bool:
        return params.min_new_tokens > 0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        return cls([r.sampling_params.min_new_tokens for r in reqs],
                   [len(r.output_ids) for r in reqs],
                   [tuple(sorted(t for t in r.stop_ids if 0 <= t < vocab_size)) for r in reqs])

    def is_active(self) -> bool:
        return any(n < m for n, m in zip(self.out_len, self.min_new))

    def cumulate_output_tokens(self, output_ids: torch.Tensor, rows: torch.Tensor) -> None:
        for r in rows.tolist():
            self.out_len[r] += 1

    def apply(self, logits: torch.Tensor) -> None:
        rows, cols = [], []
        for i, (n, m, ids) in enumerate(zip(self.out_len, self.min_new, self.stop_ids)):
            if n < m:
                rows += [i] * len(ids)
                cols += ids
        if rows:
            dev = logits.device
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")

    def filter(self, keep: torch.Tensor) -> None:
        idx = keep.tolist()
        self.min_new = [self.min_new[i] for i in idx]
        self.out_len = [self.out_len[i] for i in idx]
        self.stop_ids = [self.stop_ids[i] for i in idx]

    def merge(self, other: "BatchedMinNewTokensPenalizer") -> None:
        self.min_new += other.min_new
        self.out_len += other.out_len
        self.stop_ids += other.stop_ids
