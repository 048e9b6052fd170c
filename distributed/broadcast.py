"""Object broadcast from one rank of a gloo CPU group to the others.

Pickled bytes travel as a uint8 tensor after their length. An empty list -- the common
idle case, no new requests -- is sent as length 0: one 8-byte broadcast and nothing else.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def broadcast_pyobj(obj: Any, is_source: bool, src_world_rank: int, group) -> Any:
    """Return the source's ``obj`` on every rank of ``group`` (``obj`` is ignored elsewhere)."""
    if is_source:
        payload = b"" if isinstance(obj, list) and not obj else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src_world_rank, group=group)
    n = int(size.item())
    if n == 0:
        return []
    if is_source:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, src=src_world_rank, group=group)
    return obj if is_source else pickle.loads(data.numpy().tobytes())
