"""Gated RMSNorm of Qwen3-Next / Qwen3.5 linear attention: norm(x) * weight * silu(z), per head.

The cast order follows transformers' Qwen3_5RMSNormGated, so fp32 results match bit for bit
and bf16 results round at the same points: statistics in fp32, back to x's dtype before the
weight, the gate applied in fp32, one final cast to x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype or torch.get_default_dtype()),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z: [..., dim] -> [..., dim] in x's dtype (norm before gate)."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)
