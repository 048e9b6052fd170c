"""RMSNorm, with the residual add fused in (the pre-norm decoder's hot pattern)."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as Hugging Face's LlamaRMSNorm (statistics in fp32,
        # cast back before the weight), so fp32 results match bit-for-bit.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``forward(x)`` -> normed x; ``forward(x, residual)`` -> (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (weight stored zero-centred), Qwen3.5 / Qwen3-Next.

    Unlike Llama's, transformers' Qwen3_5RMSNorm multiplies in fp32 and casts once at the
    end; the same order here keeps fp32 bit-identical and bf16 rounding at the same point.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None):
        super().__init__(hidden_size, eps, params_dtype)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
