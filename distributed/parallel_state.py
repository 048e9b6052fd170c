"""Rank identity and the TP group handle, passed explicitly (no module-level state).

A world of ``dp_size x pp_size x tp_size`` ranks (spread over ``nnodes`` nodes, each
running ``world_size / nnodes`` consecutive ranks) is split into DP groups of
``pp_size x tp_size`` consecutive ranks, and each DP group into ``pp_size`` pipeline
stages of ``tp_size`` consecutive ranks:
world rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank. Each stage's TP group has
a *device group* (NCCL on GPU, gloo on CPU) for the tensor collectives of the TP layers
and a gloo *CPU group* for control messages (request broadcast, grammar and token
agreement). At TP group size 1 no group is created (see ``distributed/process_groups.py``);
with pipeline stages the control messages span the whole DP group
(``distributed/pipeline.py``).
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
    pp_rank: int = 0  # pipeline stage: 0 embeds the tokens, pp_size - 1 holds the logits
    pp_size: int = 1

    @classmethod
    def for_world_rank(cls, world_rank: int, tp_size: int, dp_size: int,
                       nnodes: int = 1, pp_size: int = 1) -> "RankInfo":
        world_size = tp_size * dp_size * pp_size
        if min(tp_size, dp_size, nnodes, pp_size) < 1 or not 0 <= world_rank < world_size:
            raise ValueError(f"no world rank {world_rank} with tp_size={tp_size}, "
                             f"pp_size={pp_size}, dp_size={dp_size}, nnodes={nnodes}")
        if world_size % nnodes:
            raise ValueError(f"tp_size x pp_size x dp_size = {world_size} ranks cannot be split "
                             f"evenly over --nnodes {nnodes}")
        group = tp_size * pp_size
        return cls(tp_rank=world_rank % tp_size, tp_size=tp_size,
                   dp_rank=world_rank // group, dp_size=dp_size,
                   world_rank=world_rank, world_size=world_size,
                   local_rank=world_rank % (world_size // nnodes), nnodes=nnodes,
                   pp_rank=world_rank % group // tp_size, pp_size=pp_size)

    @property
    def group_size(self) -> int:
        """Ranks in this rank's DP group: every stage's TP ranks."""
        return self.tp_size * self.pp_size

    @property
    def group_rank(self) -> int:
        """This rank's position in its DP group."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def entry_world_rank(self) -> int:
        """The DP group's entry rank: TP rank 0 of the last stage, which holds the logits
        (so logprobs never travel between stages)."""
        return self.dp_rank * self.group_size + (self.pp_size - 1) * self.tp_size

    @property
    def node_rank(self) -> int:
        return self.world_rank // (self.world_size // self.nnodes)

    @property
    def is_entry_rank(self) -> bool:
        """TP rank 0 of its DP group's last stage: the only rank that talks to the frontend."""
        return self.world_rank == self.entry_world_rank

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def name(self) -> str:
        if self.pp_size > 1:
            return f"DP{self.dp_rank}_PP{self.pp_rank}_TP{self.tp_rank}"
        return f"DP{self.dp_rank}_TP{self.tp_rank}"

    @property
    def log_prefix(self) -> str:
        if self.pp_size > 1:
            return f"[DP{self.dp_rank} PP{self.pp_rank} TP{self.tp_rank}]"
        return f"[DP{self.dp_rank} TP{self.tp_rank}]"

    @property
    def proc_title(self) -> str:
        return f"gramsync::scheduler_{self.name}"


def local_world_ranks(tp_size: int, dp_size: int, nnodes: int, node_rank: int,
                      pp_size: int = 1) -> range:
    """World ranks that run on node ``node_rank``."""
    per_node = tp_size * dp_size * pp_size // nnodes
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
