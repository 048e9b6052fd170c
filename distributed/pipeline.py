"""Pipeline parallelism's groups and messages (--pp-size).

A DP group of ``pp_size x tp_size`` ranks runs one scheduler loop per rank, as TP alone
does: every rank sees the same requests and makes the same decisions. Its stages hold
consecutive decoder layers; a step's activations go stage to stage point-to-point (each
TP rank to the same TP rank of the next stage), in micro-batches so the stages overlap
(``srt/model_executor/pipeline_forward.py``).

What keeps the stages in lock-step is the same as for TP, over a wider group:
- ``ctrl``, a gloo group over the whole DP group, carries the request broadcast (from the
  entry rank: TP rank 0 of the last stage), the grammar agreement (ready = intersection,
  failed = union over every TP x PP rank) and the start-up minimums (KV-cache size);
- the last stage samples (it holds the logits and applies the grammar mask) and
  ``broadcast_sampled_ids`` gives its ids to every rank before any of them accepts a
  token into a grammar: SGLang's PP desync (different batches on different stages,
  sglang#28424) cannot happen when no stage decides anything alone.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from distributed.parallel_state import RankInfo, TPGroup


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's place in its DP group's pipeline."""

    rank: int  # stage
    size: int
    prev_world_rank: Optional[int]  # same TP rank, previous stage (None on the first)
    next_world_rank: Optional[int]  # same TP rank, next stage (None on the last)
    entry_world_rank: int  # the last stage's TP rank 0: samples' and requests' source
    ctrl: TPGroup  # the whole DP group (control messages); rank = group rank
    p2p_group: Any = None  # activations (NCCL on GPU, gloo on CPU)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


def init_pipeline_group(rank: RankInfo, timeout_s: float, device_backend: str) -> Optional[PipelineGroup]:
    """Every rank, after ``init_process_groups``: the DP groups' control and activation
    groups (``new_group`` walks every DP group in the same order on every rank). None at
    --pp-size 1: nothing is created."""
    if rank.pp_size == 1:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_backend == "auto":
        device_backend = "nccl" if torch.cuda.is_available() else "gloo"
    mine = None
    g = rank.group_size
    for dp in range(rank.dp_size):
        ranks = list(range(dp * g, (dp + 1) * g))
        cpu = dist.new_group(ranks, timeout=timeout, backend="gloo")
        p2p = dist.new_group(ranks, timeout=timeout, backend=device_backend)
        if dp == rank.dp_rank:
            mine = (cpu, p2p)
    cpu, p2p = mine
    ctrl = TPGroup(rank.group_rank, g, cpu, cpu, name=f"dp{rank.dp_rank}")
    step = rank.tp_size
    return PipelineGroup(
        rank=rank.pp_rank, size=rank.pp_size,
        prev_world_rank=rank.world_rank - step if rank.pp_rank > 0 else None,
        next_world_rank=rank.world_rank + step if rank.pp_rank < rank.pp_size - 1 else None,
        entry_world_rank=rank.entry_world_rank, ctrl=ctrl, p2p_group=p2p)


def send_activation(t: torch.Tensor, pp: PipelineGroup):
    """Start sending ``t`` to the next stage; returns the work to wait on before ``t`` is
    reused. The receiver knows the shape: it scheduled the same batch."""
    return dist.isend(t.contiguous(), dst=pp.next_world_rank, group=pp.p2p_group)


def recv_activation(shape: tuple, dtype: torch.dtype, device, pp: PipelineGroup) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=pp.prev_world_rank, group=pp.p2p_group)
    return buf


def broadcast_sampled_ids(ids: torch.Tensor, pp: PipelineGroup) -> tuple[torch.Tensor, int]:
    """``(agreed_ids, mismatches)``: the entry rank's sampled ids on every rank of the DP
    group (the other stages pass a placeholder of the same length), and how many of this
    rank's own samples differed (the last stage's other TP ranks; 0 elsewhere)."""
    agreed = ids.to("cpu", torch.int64).clone()
    dist.broadcast(agreed, src=pp.entry_world_rank, group=pp.ctrl.cpu_group)
    mismatches = int((agreed != ids.cpu()).sum().item()) if pp.is_last else 0
    return agreed.to(ids.device), mismatches
