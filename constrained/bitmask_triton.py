"""Triton kernel: apply a packed int32 token bitmask to logits in place (bit 0 -> -inf).

Imported lazily by ``constrained.bitmask_ops`` (only when the Triton path runs), so the
rest of the package never needs triton. Under ``TRITON_INTERPRET=1`` (set before this
module is imported) the same kernel runs on CPU tensors, which is how the tests check it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 4096  # tokens per program: 128 mask words, 16 KiB of fp32 logits


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    vocab_size,
    logits_row_stride,
    logits_col_stride,
    bitmask_row_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 on big batches
    start = tl.program_id(1) * BLOCK
    # One int32 word covers 32 tokens; only words that hold a token < vocab_size are read,
    # so a mask wider than the logits is fine and its extra bits are ignored.
    words_offs = start // 32 + tl.arange(0, BLOCK // 32)
    words = tl.load(bitmask_ptr + row * bitmask_row_stride + words_offs,
                    mask=words_offs * 32 < vocab_size, other=-1)
    # Little-endian bits: token 32*w + j is bit j of word w; & 1 undoes the sign extension
    # of the arithmetic shift on negative words.
    bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1
    disallowed = tl.reshape(bits == 0, (BLOCK,))
    offs = start + tl.arange(0, BLOCK)
    ptrs = logits_ptr + row * logits_row_stride + offs * logits_col_stride
    # Store-only: allowed logits are never read or rewritten, so they stay bit-for-bit.
    tl.store(ptrs, float("-inf"), mask=disallowed & (offs < vocab_size))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on 2-D ``logits`` [B, V] with int32 ``bitmask`` [B, >= ceil(V/32)] on the
    same device; callers (``apply_token_bitmask_inplace``) validate shapes and dtypes."""
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        return
    if bitmask.stride(-1) != 1:
        bitmask = bitmask.contiguous()
    grid = (batch, triton.cdiv(vocab, BLOCK_SIZE))
    _apply_bitmask_kernel[grid](
        logits, bitmask, vocab, logits.stride(0), logits.stride(1), bitmask.stride(0),
        BLOCK=BLOCK_SIZE, num_warps=8,
    )
