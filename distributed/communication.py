"""Collectives used by the TP layers and the scheduler; each is a no-op at group size 1.

Eager steps call the shared-memory segment (or gloo) directly. While torch.compile traces
a step, the layers' collectives become the opaque ops of ``traceable_collectives.py``,
which call the same eager functions (``eager_collectives.py``) when the compiled graph runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import traceable_collectives
from distributed.eager_collectives import eager_all_gather_last_dim, eager_all_reduce, peers_absent, without_peers
from distributed.parallel_state import TPGroup

__all__ = ["tp_all_reduce", "tp_all_gather_last_dim", "tp_min_int", "without_peers"]


def tp_all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across the TP group (in place when
    eager; a new tensor inside a compiled step)."""
    if tp.is_single:
        return x
    if torch.compiler.is_compiling():
        return traceable_collectives.all_reduce(x, tp)
    return eager_all_reduce(x, tp)


def tp_all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
    if tp.is_single:
        return x
    if torch.compiler.is_compiling():
        return traceable_collectives.all_gather_last_dim(x, tp)
    return eager_all_gather_last_dim(x, tp)


def tp_min_int(value: int, tp: TPGroup) -> int:
    """The smallest ``value`` over the TP group's CPU group (e.g. KV-cache size, which each
    rank profiles from its own free memory but every rank must share)."""
    if tp.is_single or peers_absent(tp):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
