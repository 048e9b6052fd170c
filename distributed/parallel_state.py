"""Rank identity and the TP group handle, passed explicitly (no module-level state).

A world of ``dp_size x tp_size`` ranks (spread over ``nnodes`` nodes, each running
``world_size / nnodes`` consecutive ranks) is split into DP groups of ``tp_size``
consecutive ranks: world rank = dp_rank * tp_size + tp_rank. Each TP group has a *device
group* (NCCL on GPU, gloo on CPU) for the tensor collectives of the TP layers and a gloo
*CPU group* for control messages (request broadcast, grammar and token agreement).
At TP group size 1 no group is created (see ``distributed/process_groups.py``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class RankInfo:
    """Who this process is. Frozen: it crosses process boundaries at spawn time."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    nnodes: int = 1

    @classmethod
    def for_world_rank(cls, world_rank: int, tp_size: int, dp_size: int,
                       nnodes: int = 1) -> "RankInfo":
        world_size = tp_size * dp_size
        if min(tp_size, dp_size, nnodes) < 1 or not 0 <= world_rank < world_size:
            raise ValueError(f"no world rank {world_rank} with tp_size={tp_size}, "
                             f"dp_size={dp_size}, nnodes={nnodes}")
        if world_size % nnodes:
            raise ValueError(f"tp_size x dp_size = {world_size} ranks cannot be split evenly "
                             f"over --nnodes {nnodes}")
        return cls(tp_rank=world_rank % tp_size, tp_size=tp_size,
                   dp_rank=world_rank // tp_size, dp_size=dp_size,
                   world_rank=world_rank, world_size=world_size,
                   local_rank=world_rank % (world_size // nnodes), nnodes=nnodes)

    @property
    def node_rank(self) -> int:
        return self.world_rank // (self.world_size // self.nnodes)

    @property
    def is_entry_rank(self) -> bool:
        """TP rank 0 of its DP group: the only rank that talks to the frontend."""
        return self.tp_rank == 0

    @property
    def name(self) -> str:
        return f"DP{self.dp_rank}_TP{self.tp_rank}"

    @property
    def log_prefix(self) -> str:
        return f"[DP{self.dp_rank} TP{self.tp_rank}]"

    @property
    def proc_title(self) -> str:
        return f"gramsync::scheduler_{self.name}"


def local_world_ranks(tp_size: int, dp_size: int, nnodes: int, node_rank: int) -> range:
    """World ranks that run on node ``node_rank``."""
    per_node = tp_size * dp_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a layer or scheduler works in.

    ``device_group``/``cpu_group`` are ``torch.distributed.ProcessGroup`` objects, or
    ``None`` when ``size == 1`` (then every collective is skipped).
    """

    rank: int = 0
    size: int = 1
    device_group: Optional[Any] = None
    cpu_group: Optional[Any] = None
    # distributed.shm_collectives.ShmCollectives where the group's ranks share a CPU
    # machine: the tensor collectives go through shared memory instead of gloo.
    shm: Optional[Any] = None
    # Names the group to the compiled steps' collective ops (distributed/traceable_collectives.py).
    name: str = "tp"
    # Per thread: ``without_peers`` (a compile warm-up beside the serving thread) sets
    # ``local.without_peers`` so that thread's collectives stay local.
    local: threading.local = field(default_factory=threading.local, compare=False, repr=False)

    @property
    def is_single(self) -> bool:
        return self.size == 1


SINGLE_RANK = TPGroup()
