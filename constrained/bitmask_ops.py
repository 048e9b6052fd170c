"""Applying a packed token bitmask to logits: int32 [B, ceil(V/32)], bit 1 = allowed.

Portable torch path (unpack the bits, mask with -inf); the constrained-generation issue
adds a Triton kernel for CUDA and a faster CPU path behind the same function.
"""
from __future__ import annotations

import torch


def allocate_token_bitmask(batch_size: int, vocab_size: int, device="cpu") -> torch.Tensor:
    """All tokens allowed."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf; columns past the mask stay untouched
    only if the mask covers them, so the mask must be at least as wide as the logits."""
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[-1] * 32} tokens, logits have {vocab}")
    logits.masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))
