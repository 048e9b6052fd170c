"""Create the process groups of one rank: the world (start-up only) and its TP group.

``torch.distributed.new_group`` must be called by every rank for every group, in the same
order, so each rank walks all DP groups and keeps the one it belongs to.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional

from distributed.parallel_state import SINGLE_RANK, RankInfo, TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistConfig:
    """How a rank joins the world. Frozen: crosses the spawn boundary."""

    # "file://PATH" (one node: a file in the private run directory), "tcp://host:port"
    # (several nodes: torch's TCPStore at --dist-init-addr) or "env://" (torchrun's store)
    init_method: str
    device_backend: str  # "gloo" (CPU), "nccl" (CUDA) or "auto" (nccl where CUDA is available)
    timeout_s: float  # rendezvous and every collective (gloo/NCCL raise past it)
    # CPU TP groups on one machine reduce through shared memory (distributed/shm_collectives.py)
    shm_collectives: bool = True


def init_process_groups(rank: RankInfo, cfg: DistConfig) -> tuple[TPGroup, Optional[Any]]:
    """Join the world (if it has more than one rank) and build this rank's TP group (its
    stage's, with pipeline stages; their groups: ``distributed.pipeline``).

    Returns ``(tp_group, world_cpu_group)``; at world size 1 nothing is created and the
    result is ``(SINGLE_RANK, None)``. The world group is gloo: it carries start-up
    messages only (endpoints, the shared seed); the TP groups carry all steady-state work.
    """
    if rank.world_size == 1:
        return SINGLE_RANK, None
    import torch  # here, not at the top: the frontend imports DistConfig without torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    backend = cfg.device_backend
    if backend == "auto":  # as ServerArgs.resolved_device decides the rank's device
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    logger.info("%s joining world of %d ranks at %s (timeout %.0f s)", rank.log_prefix,
                rank.world_size, cfg.init_method, cfg.timeout_s)
    dist.init_process_group("gloo", init_method=cfg.init_method, world_size=rank.world_size,
                            rank=rank.world_rank, timeout=timeout)
    world = dist.group.WORLD
    if rank.tp_size == 1:
        return SINGLE_RANK, world
    if backend == "nccl":  # NCCL binds each communicator to the current device
        torch.cuda.set_device(rank.local_rank)
    mine = None
    for stage in range(rank.dp_size * rank.pp_size):  # one TP group per stage of each DP group
        ranks = list(range(stage * rank.tp_size, (stage + 1) * rank.tp_size))
        device = dist.new_group(ranks, timeout=timeout, backend=backend)
        # Separate even on CPU: control messages never queue behind tensor traffic.
        cpu = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if stage == rank.world_rank // rank.tp_size:
            dp, pp = divmod(stage, rank.pp_size)
            name = f"tp_dp{dp}" if rank.pp_size == 1 else f"tp_dp{dp}_pp{pp}"
            mine = TPGroup(rank.tp_rank, rank.tp_size, device, cpu, name=name)
    assert mine is not None
    if backend == "gloo" and _tp_group_on_one_node(rank):
        from distributed.shm_collectives import create_shm_collectives

        shm = create_shm_collectives(rank.tp_rank, rank.tp_size, mine.cpu_group, cfg.timeout_s,
                                     cfg.shm_collectives, rank.log_prefix)
        mine = dataclasses.replace(mine, shm=shm)
    from distributed.traceable_collectives import register_group

    register_group(mine)  # the compiled steps' collectives find it by name
    return mine, world


def _tp_group_on_one_node(rank: RankInfo) -> bool:
    """Whether the layout puts this rank's whole TP group on one node (the same answer on
    every rank of the group)."""
    per_node = rank.world_size // rank.nnodes
    first = rank.world_rank - rank.tp_rank
    return first // per_node == (first + rank.tp_size - 1) // per_node


def destroy_process_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
