"""Prompt logprobs kept next to the KV cache, one entry per KV slot.

Slot s of a cached token p holds what scoring a prompt reported for p: the logprob of p
given the tokens before it, and its top alternatives. That is a function of the prefix
alone, like the K/V in the same slot, so whatever the radix cache shares it can share too,
and freeing (evicting) a slot frees both.

Two parts:
- ``top_count`` (every rank, on the KV slots' device, so resetting the slots every
  decode step allocates costs no host sync): how many top alternatives slot s holds, -1
  for no entry. The radix cache's matches depend on it, so it changes only in steps every
  rank takes (``reset`` at allocation, ``write`` at insertion into the tree) and stays
  identical.
- the numbers (only on the rank that computes logprobs, ``holds_values``; host memory,
  where logprobs are read anyway): float32, as the sampler's ``tolist()`` produced them,
  so a cached entry reads back bit for bit.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

TopLogprobs = tuple[tuple[int, float], ...]
NO_ENTRY = -1


class PromptLogprobPool:
    def __init__(self, size: int, max_top: int, holds_values: bool, device: str = "cpu"):
        self.max_top = max_top
        self.holds_values = holds_values
        self.top_count = torch.full((size + 1,), NO_ENTRY, dtype=torch.int8, device=device)
        if holds_values:
            self.logprob = torch.zeros(size + 1, dtype=torch.float32)
            self.top_ids = torch.zeros((size + 1, max_top), dtype=torch.int32)
            self.top_logprobs = torch.zeros((size + 1, max_top), dtype=torch.float32)

    @staticmethod
    def bytes_per_token(max_top: int) -> int:
        """Count, logprob, and ``max_top`` (id, logprob) pairs per slot (counted on every
        rank, though only one holds the numbers: the KV size is the minimum over ranks)."""
        return 1 + 4 + 8 * max_top

    def reset(self, slots: torch.Tensor) -> None:
        """Newly allocated slots hold nothing (they may have held an evicted entry)."""
        self.top_count[slots] = NO_ENTRY

    def counts(self, slots: torch.Tensor) -> torch.Tensor:
        return self.top_count[slots]

    def write(self, slots: torch.Tensor, top_n: int,
              entries: Optional[Sequence[tuple[float, TopLogprobs]]]) -> None:
        """Store entries with ``top_n`` alternatives computed at ``slots`` (``entries`` only
        on the rank that holds values; a listed top may be shorter than ``top_n`` where the
        model gave -inf)."""
        self.top_count[slots] = top_n
        if not self.holds_values:
            return
        slots = slots.cpu()
        self.logprob[slots] = torch.tensor([lp for lp, _ in entries], dtype=torch.float32)
        if top_n == 0:
            return
        if all(len(top) == top_n for _, top in entries):  # the usual case: one copy each
            pairs = [pair for _, top in entries for pair in top]
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int32).view(-1, top_n)
            vals = torch.tensor([v for _, v in pairs], dtype=torch.float32).view(-1, top_n)
        else:  # some tops stop early (-inf alternatives): pad with id -1
            ids = torch.full((len(entries), top_n), -1, dtype=torch.int32)
            vals = torch.zeros((len(entries), top_n), dtype=torch.float32)
            for row, (_, top) in enumerate(entries):
                if top:
                    ids[row, :len(top)] = torch.tensor([t for t, _ in top], dtype=torch.int32)
                    vals[row, :len(top)] = torch.tensor([v for _, v in top], dtype=torch.float32)
        self.top_ids[slots, :top_n] = ids
        self.top_logprobs[slots, :top_n] = vals

    def read(self, slots: torch.Tensor, top_n: int) -> list[tuple[float, TopLogprobs]]:
        """Entries at ``slots`` with their first ``top_n`` alternatives (the caller checked
        ``counts(slots) >= top_n``)."""
        slots = slots.cpu()
        lps = self.logprob[slots].tolist()
        if top_n == 0:
            return [(lp, ()) for lp in lps]
        ids = self.top_ids[slots, :top_n].tolist()
        vals = self.top_logprobs[slots, :top_n].tolist()
        return [(lp, tuple((t, v) for t, v in zip(i, v_) if t >= 0))
                for lp, i, v_ in zip(lps, ids, vals)]
