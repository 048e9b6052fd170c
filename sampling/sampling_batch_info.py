"""Batched sampling state for one scheduled batch.

``apply_logits_bias`` is the seam of the full pipeline (penalties -> grammar vocab mask ->
logit bias, in that order); the penalty, mask and bias stages arrive with the sampling and
grammar issues. The per-row noise for sampling is keyed by (seed, output position) for
seeded requests, so a seeded request samples the same tokens in any batch and on any rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sampling.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) pairs


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] float32
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] int64, vocab size where disabled
    min_ps: torch.Tensor  # [B]
    greedy_mask: torch.Tensor  # [B] bool
    seeds: tuple[Optional[int], ...]
    positions: tuple[int, ...]  # output position each row samples (for seeded noise)
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    generator: torch.Generator  # shared, for unseeded rows; identical on every rank

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], positions: Sequence[int],
                    vocab_size: int, device: str, generator: torch.Generator) -> "SamplingBatchInfo":
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            seeds=tuple(p.seed for p in params),
            positions=tuple(positions),
            is_all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            need_top_k=any(k < vocab_size and not g for k, g in zip(top_ks, greedy)),
            need_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
            generator=generator,
        )

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """In place: penalties, then the grammar vocab mask, then logit bias (later issues)."""
        return None

    def exponential_noise(self, shape: torch.Size, device) -> torch.Tensor:
        """Exp(1) noise per row; argmax(probs / noise) is an exact sample from probs."""
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        unseeded = [i for i, s in enumerate(self.seeds) if s is None]
        if unseeded:
            block = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=device)
            block.exponential_(generator=self.generator)
            noise[unseeded] = block
        for i, seed in enumerate(self.seeds):
            if seed is not None:
                g = torch.Generator(device=device)
                g.manual_seed((seed * _SEED_MIX + self.positions[i]) % (2**63))
                noise[i].exponential_(generator=g)
        return noise
