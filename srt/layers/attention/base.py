"""The interface every attention backend implements (SGLang's ``AttentionBackend``, small).

The model runner calls ``init_forward_metadata(fb)`` once per step, outside the layers
(and outside any compiled region), so per-step tensors such as a decode batch's KV slot
table are built once rather than once per layer. Each attention layer then writes its new
K/V into the pool and calls ``forward_decode`` or ``forward_extend``, which read the pool.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    name: str = "base"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Build this step's shared tensors on ``fb`` (default: nothing)."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        """q ``[B, H, D]`` -> ``[B, H, D]``; the new token's K/V are already in the pool."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer,
                       fb: ForwardBatch) -> torch.Tensor:
        """q ``[T, H, D]``, k/v ``[T, KVH, D]`` (also already in the pool) -> ``[T, H, D]``."""
