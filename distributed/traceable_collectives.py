"""The TP collectives as torch custom ops, so a compiled step keeps our fast collectives.

Dynamo cannot trace the shared-memory collective (numpy flags, spin waits on a mapped
segment), and tracing torch's own ``dist.all_reduce`` instead pins a compiled step to
gloo (~1.6 ms a call on loopback against ~10 us through the segment: 61 calls a decode
step). As ``torch.library`` custom ops they are one opaque call each inside the graph:
Inductor schedules around them, and when the graph runs they call the eager functions of
``eager_collectives.py`` (segment, gloo fallback, ``without_peers``). vLLM compiles its TP
collectives the same way.

A custom op takes tensors and plain values, not a process-group object, so a group is
passed by name and looked up in ``_GROUPS`` (``register_group`` when the group is made):
the one module-level table here, for the reason torch keeps its own table of c10d group
names.
"""
from __future__ import annotations

import torch

from distributed.eager_collectives import eager_all_gather_last_dim, eager_all_reduce
from distributed.parallel_state import TPGroup

_GROUPS: dict[str, TPGroup] = {}


def register_group(tp: TPGroup) -> None:
    """Make ``tp`` reachable by its name from compiled graphs (one group per name)."""
    _GROUPS[tp.name] = tp


def _group(name: str) -> TPGroup:
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeError(f"TP group {name!r} was never registered (register_group)") from None


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return torch.ops.gramsync.tp_all_reduce(x, tp.name)


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return torch.ops.gramsync.tp_all_gather_last_dim(x, tp.name, tp.size)


@torch.library.custom_op("gramsync::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    return eager_all_reduce(x.clone(), _group(group))  # functional: the input stays as it was


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("gramsync::tp_all_gather_last_dim", mutates_args=())
def _all_gather_op(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return eager_all_gather_last_dim(x, _group(group))


@_all_gather_op.register_fake
def _(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * size))
