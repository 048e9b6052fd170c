"""Token sampler: greedy fast path, else temperature + top-k/top-p/min-p + exact sampling.

Minimal version (single-rank engine issue): top-k/top-p use a sort; the FlashInfer-style
sort-free sampler replaces this with the sampling-pipeline issue.
"""
from __future__ import annotations

import torch

from sampling.sampling_batch_info import SamplingBatchInfo


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if info.is_all_greedy:
            return torch.argmax(logits, dim=-1)
        probs = torch.softmax(logits.float() / info.temperatures, dim=-1)
        if info.need_top_k or info.need_top_p:
            probs = _top_k_top_p_renorm(probs, info.top_ks, info.top_ps)
        if info.need_min_p:
            floor = probs.amax(dim=-1, keepdim=True) * info.min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = info.exponential_noise(probs.shape, probs.device)
        ids = torch.argmax(probs / noise, dim=-1)
        if info.greedy_mask.any():
            ids = torch.where(info.greedy_mask, torch.argmax(logits, dim=-1), ids)
        return ids


def _top_k_top_p_renorm(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    drop = ranks >= top_ks.unsqueeze(1)
    # Keep a token while the mass strictly before it is below top_p (always keeps the first).
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_ps.unsqueeze(1)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
