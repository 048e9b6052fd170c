"""The collectives as they run eagerly: the shared-memory segment where the group's ranks
share a machine, else gloo/NCCL; inside ``without_peers`` they stay local.

Both communication.py (eager steps) and traceable_collectives.py (the opaque ops a compiled
step calls) run these, so neither imports the other.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from distributed.parallel_state import TPGroup


def _shm_usable(tp: TPGroup) -> bool:
    return tp.shm is not None


def peers_absent(tp: TPGroup) -> bool:
    return getattr(tp.local, "without_peers", False)


@contextlib.contextmanager
def without_peers(tp: TPGroup) -> Iterator[None]:
    """This thread's collectives on ``tp`` stay local while inside: a compile warm-up runs
    the model beside the serving thread, and the peers are busy serving. Its results are
    partial sums and repeated shards (wrong, and discarded: the warm-up writes only the
    dummy KV slot); the compiled graphs and their shapes are what it is for."""
    before = peers_absent(tp)
    tp.local.without_peers = True
    try:
        yield
    finally:
        tp.local.without_peers = before


def eager_all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if peers_absent(tp):
        return x
    if not _shm_usable(tp) or not tp.shm.all_reduce(x):
        dist.all_reduce(x, group=tp.device_group)
    return x


def eager_all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if peers_absent(tp):
        return torch.cat([x] * tp.size, dim=-1)
    if _shm_usable(tp):
        gathered = tp.shm.all_gather_last_dim(x.contiguous())
        if gathered is not None:
            return gathered
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.device_group)
    return torch.cat(parts, dim=-1)
