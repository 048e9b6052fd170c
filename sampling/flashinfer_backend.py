"""FlashInfer's fused sort-free sampling kernels, used on CUDA when the package is installed.

FlashInfer samples by rejection with pivots inside one kernel (no sort). Its randomness
comes from a Philox generator per batch, not per row, so batches with seeded requests stay
on the hashed-uniform path (``sort_free``) to keep those requests reproducible. Batches
with min-p also stay there: FlashInfer's min-p kernel works on top-k/top-p-renormalised
probabilities, which would change the kept set of rows that also use top-p.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def usable(logits: torch.Tensor, info) -> bool:
    return (logits.is_cuda and installed() and not info.need_min_p
            and all(s is None for s in info.seeds))


def sample(logits: torch.Tensor, info) -> torch.Tensor:
    """Joint top-k / top-p (the same kept set as ``sort_free``), one fused kernel."""
    from flashinfer import sampling as fs

    probs = torch.softmax(logits, dim=-1)
    ids = fs.top_k_top_p_sampling_from_probs(probs, info.top_ks.int(), info.top_ps,
                                             filter_apply_order="joint", generator=info.generator)
    return ids.long()
