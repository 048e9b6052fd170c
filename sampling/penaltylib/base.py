"""The interface every batched penalizer implements.

A penalizer holds one row of state per request of the running batch. It is built from the
requests (their prompt and the output produced so far, so a request resumed after a
retraction gets the same state as one that never left), updated with every step's sampled
tokens, filtered when requests leave and merged when requests join, so the batch never
rebuilds it from scratch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, Sequence

import torch

from sampling.sampling_params import SamplingParams


class PenalizedRequest(Protocol):
    """What a penalizer reads from a request (``srt.scheduler.req.Req`` has these)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]


class BatchedPenalizer(ABC):
    @staticmethod
    @abstractmethod
    def is_required(params: SamplingParams) -> bool:
        """Whether a request with these parameters needs this penalizer."""

    @classmethod
    @abstractmethod
    def build(cls, reqs: Sequence[PenalizedRequest], vocab_size: int,
              device: torch.device) -> "BatchedPenalizer":
        """State for ``reqs``; rows that do not need the penalty get neutral values."""

    @abstractmethod
    def is_active(self) -> bool:
        """Whether any row still changes logits (after a filter the penalizer may be dropped)."""

    @abstractmethod
    def cumulate_output_tokens(self, output_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Record new output tokens: ``output_ids[i]`` belongs to row ``rows[i]`` (int64
        [N]; one per row after sampling, any number per row for fast-forwarded tokens)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> None:
        """Penalize ``logits`` [B, V] in place."""

    @abstractmethod
    def filter(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (int64 indices, in order)."""

    @abstractmethod
    def merge(self, other: "BatchedPenalizer") -> None:
        """Append ``other``'s rows after ours."""


class RowTensorPenalizer(BatchedPenalizer):
    """A penalizer whose state is tensors with one row per request (named in ROW_FIELDS):
    filtering and merging are the same row selection / concatenation for all of them."""

    ROW_FIELDS: tuple[str, ...] = ()

    def filter(self, keep: torch.Tensor) -> None:
        for name in self.ROW_FIELDS:
            setattr(self, name, getattr(self, name)[keep])

    def merge(self, other: "RowTensorPenalizer") -> None:
        for name in self.ROW_FIELDS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))


def output_counts(reqs: Sequence[PenalizedRequest], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """float32 [B, V]: how many times each token occurs in each request's output so far."""
    counts = torch.zeros((len(reqs), vocab_size), dtype=torch.float32, device=device)
    for i, r in enumerate(reqs):
        if r.output_ids:
            ids = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
            counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts


def row_values(reqs: Sequence[PenalizedRequest], field: str, device: torch.device) -> torch.Tensor:
    """float32 [B, 1] of one sampling parameter, for broadcasting over the vocabulary."""
    values = [float(getattr(r.sampling_params, field)) for r in reqs]
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
