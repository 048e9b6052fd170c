"""Collectives used by the TP layers and the scheduler; each is a no-op at group size 1.

Eager steps call the shared-memory segment (or gloo) directly. While torch.compile traces
a step, the layers' collectives become the opaque ops of ``traceable_collectives.py``,
which call back into the same eager functions when the compiled graph runs.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from distributed import traceable_collectives
from distributed.parallel_state import TPGroup


def _shm_usable(tp: TPGroup) -> bool:
    return tp.shm is not None


def _peers_absent(tp: TPGroup) -> bool:
    return getattr(tp.local, "without_peers", False)


@contextlib.contextmanager
def without_peers(tp: TPGroup) -> Iterator[None]:
    """This thread's collectives on ``tp`` stay local while inside: a compile warm-up runs
    the model beside the serving thread, and the peers are busy serving. Its results are
    partial sums and repeated shards (wrong, and discarded: the warm-up writes only the
    dummy KV slot); the compiled graphs and their shapes are what it is for."""
    before = _peers_absent(tp)
    tp.local.without_peers = True
    try:
        yield
    finally:
        tp.local.without_peers = before


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


def eager_all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if _peers_absent(tp):
        return x
    if not _shm_usable(tp) or not tp.shm.all_reduce(x):
        dist.all_reduce(x, group=tp.device_group)
    return x


def eager_all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if _peers_absent(tp):
        return torch.cat([x] * tp.size, dim=-1)
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
    if tp.is_single or _peers_absent(tp):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
