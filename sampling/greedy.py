"""Greedy token ids: the first maximal logit of each row, fast on CPU.

torch's CPU ``argmax`` over a row runs a scalar loop: ~120 us for SmolLM2's 49,152 logits
and ~930 us for 16 rows (2 threads, AVX-512 Xeon), where ``amax`` is vectorised (14 and
40 us). So on CPU: each block of ``BLOCK`` logits' max (one vectorised pass), the row max
from those, the first block that holds it, and ``argmax`` inside that block only. The
answer is torch.argmax's, ties included (the first maximal index), for rows whose max is
finite: the Sampler sanitizes every row first (NaN -> -inf, +inf -> a large finite value,
an all -inf row -> uniform), so that always holds there.

Once the process has loaded gramsync's CPU kernel library (every CPU scheduler does),
``native_greedy`` takes each row's first maximal logit and checks that its max is finite in
one C++ pass for batches below MIN_ROWS (sampling/greedy_cpu.cpp: 28 against 73 us for one
row of 49,152, sanitize check and argmax, fp32, AVX512 EPYC); a batch with a non-finite row
returns None and goes the Sampler's usual way.
"""
from __future__ import annotations

import torch

BLOCK = 1024
# Below this many rows torch.argmax stays: inside the served step (bf16, same process,
# alternating) one row took 0.44-0.46 ms of sampling with it against 0.52-0.56 with the
# blocks (their dozen small ops cost more than one row's scalar loop there); 16 rows took
# 1.35-1.76 against 0.91-0.99 ms.
MIN_ROWS = 4


_NATIVE = None


def native_greedy(logits: torch.Tensor) -> torch.Tensor | None:
    """int64 ``[B]``, torch.argmax's answer, where the C++ op is loaded and every row's max
    is finite (no sanitizing needed); else None."""
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = getattr(torch.ops.gramsync, "greedy_argmax", None)
        if _NATIVE is None:
            return None
    # One thread, one row at a time (~25 us a row): from MIN_ROWS rows the blocks below are faster.
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.stride(1) != 1 or len(logits) >= MIN_ROWS:
        return None
    ids, finite = _NATIVE(logits)
    return ids if bool(finite.all()) else None


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: ``torch.argmax(logits, dim=-1)`` for float ``[B, V]`` logits whose
    rows each have a finite max."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 4 * BLOCK or rows < MIN_ROWS:
        return torch.argmax(logits, dim=-1)
    full = vocab // BLOCK
    block_max = logits[:, :full * BLOCK].view(rows, full, BLOCK).amax(dim=-1)
    if vocab > full * BLOCK:
        block_max = torch.cat([block_max, logits[:, full * BLOCK:].amax(dim=-1, keepdim=True)], dim=1)
    row_max = block_max.amax(dim=-1, keepdim=True)
    first_block = (block_max == row_max).to(torch.uint8).argmax(dim=-1)  # [B], a few dozen each
    start = first_block * BLOCK
    cols = start.unsqueeze(1) + torch.arange(BLOCK, device=logits.device)
    window = logits.gather(1, cols.clamp(max=vocab - 1))
    if vocab > full * BLOCK:  # the last, short block: its overhang is never the max
        window.masked_fill_(cols >= vocab, float("-inf"))
    return start + window.argmax(dim=-1)
