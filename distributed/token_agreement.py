"""The agreement point for sampled tokens: when a batch holds grammars, every rank of the
TP group must feed the same token into its grammar matchers, or their masks (and then
their batches) drift apart. SGLang takes the element-wise minimum over the group; so do we.

Logits are all-gathered (identical bytes on every rank) and seeded sampling draws the
same numbers everywhere, so the ids already agree in practice; ``mismatches`` counts the
rows where they did not, so that claim is measured, not assumed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distributed.parallel_state import TPGroup


def agree_on_sampled_ids(ids: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, int]:
    """``(agreed_ids, mismatches)``: element-wise MIN over the TP group, and how many of
    this rank's ids differed from it. No-op at group size 1."""
    if tp.is_single:
        return ids, 0
    agreed = ids.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.device_group)
    return agreed, int((agreed != ids).sum().item())
