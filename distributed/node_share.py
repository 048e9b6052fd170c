"""One start-up agreement point: every rank takes a value from its own node's first rank
(local rank 0), e.g. the path of a private directory only that rank could create."""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from distributed.parallel_state import RankInfo


def share_from_node_leader(rank: RankInfo, world: Optional[Any], value: Any) -> Any:
    """``value`` of local rank 0 of this rank's node (``value`` is ignored on the others).

    One ``all_gather_object`` over the gloo world group, reached by every rank of the
    world (call it unconditionally at start-up); with no world (size 1) nothing is sent."""
    if world is None:
        return value
    mine = (rank.node_rank, rank.local_rank, value if rank.local_rank == 0 else None)
    gathered: list = [None] * rank.world_size
    dist.all_gather_object(gathered, mine, group=world)
    for node_rank, local_rank, leader_value in gathered:
        if node_rank == rank.node_rank and local_rank == 0:
            return leader_value
    raise RuntimeError(f"{rank.log_prefix} no local rank 0 on node {rank.node_rank}")
