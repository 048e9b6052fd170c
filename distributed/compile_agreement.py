"""The agreement point for the compiled steps: every rank of a TP group starts using them
in the same scheduler iteration.

Each rank compiles its own graphs (its own shards, on its own thread) and finishes when
it finishes. Results would stay consistent even if ranks switched at different steps
(every layer's output is all-reduced, so a rank's rounding is shared, never private), but
a recompile or a warm-up beside a peer waiting in a collective is how ranks stall, and a
run whose step-to-step numerics depend on which rank compiled faster cannot be reproduced.
So, as with grammars, each rank reports its state and the group takes the minimum: the
compiled steps start when every rank is done, and a graph that failed on any rank is used
by none. One small collective per iteration, only until the switch is decided.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distributed.parallel_state import TPGroup

PENDING, UNUSED, COMPILED = 0, 1, 2  # ordered: the minimum is the group's answer


def agree_on_compiled_steps(states: list[int], tp: TPGroup) -> list[int]:
    """Element-wise minimum of each rank's states (one per compiled step kind) over the TP
    group. Identity at group size 1."""
    if tp.is_single:
        return list(states)
    t = torch.tensor(states, dtype=torch.int64)
    if tp.shm is None or not tp.shm.all_reduce(t, op="min"):
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return [int(v) for v in t.tolist()]
