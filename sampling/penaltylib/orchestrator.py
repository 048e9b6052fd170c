"""Runs only the penalizers some request of the batch needs, in a fixed order:
repetition (multiplicative), frequency and presence (additive), then min_new_tokens
(-inf on stop ids, last so no penalty can lift it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from sampling.penaltylib.base import BatchedPenalizer, PenalizedRequest
from sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer
from sampling.sampling_params import SamplingParams

PENALIZER_ORDER: tuple[type[BatchedPenalizer], ...] = (
    BatchedRepetitionPenalizer, BatchedFrequencyPenalizer, BatchedPresencePenalizer,
    BatchedMinNewTokensPenalizer,
)


@dataclass(frozen=True)
class _NeutralRequest:
    """Stands in for rows of a batch that never needed a penalizer, when merging."""

    sampling_params: SamplingParams = SamplingParams()
    origin_input_ids: list = field(default_factory=list)
    output_ids: list = field(default_factory=list)
    stop_ids: frozenset = frozenset()


class BatchedPenalizerOrchestrator:
    def __init__(self, batch_size: int, vocab_size: int, device: torch.device,
                 penalizers: dict[type, BatchedPenalizer]):
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.device = device
        self.penalizers = penalizers

    @classmethod
    def build(cls, reqs: Sequence[PenalizedRequest], vocab_size: int,
              device: torch.device) -> "BatchedPenalizerOrchestrator":
        needed = {kind: kind.build(reqs, vocab_size, device) for kind in PENALIZER_ORDER
                  if any(kind.is_required(r.sampling_params) for r in reqs)}
        return cls(len(reqs), vocab_size, device, needed)

    @property
    def is_required(self) -> bool:
        return bool(self.penalizers)

    def apply(self, logits: torch.Tensor) -> None:
        for kind in PENALIZER_ORDER:
            p = self.penalizers.get(kind)
            if p is not None:
                p.apply(logits)

    def cumulate_output_tokens(self, output_ids: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """One token per row (``rows`` None), or ``output_ids[i]`` for row ``rows[i]``."""
        if rows is None:
            rows = torch.arange(len(output_ids), device=output_ids.device)
        for p in self.penalizers.values():
            p.cumulate_output_tokens(output_ids, rows)

    def filter(self, keep: torch.Tensor) -> None:
        self.batch_size = len(keep)
        for kind, p in list(self.penalizers.items()):
            p.filter(keep)
            if self.batch_size == 0 or not p.is_active():
                del self.penalizers[kind]  # no remaining request needs it

    def merge(self, other: Optional["BatchedPenalizerOrchestrator"]) -> None:
        if other is None:
            return
        for kind in PENALIZER_ORDER:
            mine, theirs = self.penalizers.get(kind), other.penalizers.get(kind)
            if mine is None and theirs is None:
                continue
            if mine is None:
                mine = self._neutral(kind, self.batch_size)
            if theirs is None:
                theirs = self._neutral(kind, other.batch_size)
            mine.merge(theirs)
            self.penalizers[kind] = mine
        self.batch_size += other.batch_size

    def _neutral(self, kind: type[BatchedPenalizer], n: int) -> BatchedPenalizer:
        return kind.build([_NeutralRequest()] * n, self.vocab_size, self.device)
