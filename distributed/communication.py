"""Collectives used by the TP layers and the scheduler; each is a no-op at group size 1."""
from __future__ import annotations

import torch
import torch.distributed as dist

from distributed.parallel_state import TPGroup


def _shm_usable(tp: TPGroup) -> bool:
    """The group has a shared-memory segment and torch.compile is not tracing (a compiled
    step keeps torch's own traceable collective)."""
    return tp.shm is not None and not torch.compiler.is_compiling()


def tp_all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across the TP group (in place)."""
    if tp.is_single:
        return x
    if not _shm_usable(tp) or not tp.shm.all_reduce(x):
        dist.all_reduce(x, group=tp.device_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    if tp.is_single:
        return x
    if _shm_usable(tp):
        gathered = tp.shm.all_gather_last_dim(x.contiguous())
        if gathered is not None:
            return gathered
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)


def tp_min_int(value: int, tp: TPGroup) -> int:
    """The smallest ``value`` over the TP group's CPU group (e.g. KV-cache size, which each
    rank profiles from its own free memory but every rank must share)."""
    if tp.is_single:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
