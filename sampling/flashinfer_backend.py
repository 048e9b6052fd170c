"""FlashInfer's fused sort-free sampling kernels, used on CUDA when the package is installed.

FlashInfer samples by rejection with pivots inside one kernel (no sort). Its randomness
comes from a Philox generator per batch, not per row, so batches with seeded requests stay
on the hashed-uniform path (``sort_free``) to keep those requests reproducible.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def usable(logits: torch.Tensor, info) -> bool:
    return logits.is_cuda and installed() and all(s is None for s in info.seeds)


def sample(logits: torch.Tensor, info) -> torch.Tensor:
    """SGLang's use of the kernels: joint top-k/top-p, or renormalise then min-p."""
    from flashinfer import sampling as fs

    probs = torch.softmax(logits, dim=-1)
    gen = info.generator
    if info.need_min_p:
        probs = fs.top_k_renorm_probs(probs, info.top_ks.int())
        probs = fs.top_p_renorm_probs(probs, info.top_ps)
        ids = fs.min_p_sampling_from_probs(probs, info.min_ps, generator=gen)
    else:
        ids = fs.top_k_top_p_sampling_from_probs(probs, info.top_ks.int(), info.top_ps,
                                                 filter_apply_order="joint", generator=gen)
    return ids.long()
