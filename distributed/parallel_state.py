"""Rank identity and process groups, passed explicitly (no module-level state).

A world of ``nnodes x dp_size x tp_size`` ranks is split into DP groups of ``tp_size``
consecutive ranks. Each TP group has a *device group* (NCCL on GPU, gloo on CPU) for the
tensor collectives of the TP layers and a gloo *CPU group* for control messages
(request broadcast, grammar agreement). At group size 1 nothing is created.
"""
from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def is_entry_rank(self) -> bool:
        """TP rank 0 of its DP group: the only rank that talks to the frontend."""
        return self.tp_rank == 0

    @property
    def log_prefix(self) -> str:
        return f"[DP{self.dp_rank} TP{self.tp_rank}]"

    @property
    def proc_title(self) -> str:
        return f"gramsync::scheduler_DP{self.dp_rank}_TP{self.tp_rank}"


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

    @property
    def is_single(self) -> bool:
        return self.size == 1


SINGLE_RANK = TPGroup()
