"""The one agreement point for grammar compiles: which queued requests every rank of a TP
group may schedule (ready on all ranks) and which it must abort (failed on any rank).

Each rank reports indices into its grammar queue, which is identical on every rank (same
requests, same order), so the indices mean the same requests everywhere."""
from __future__ import annotations

import torch.distributed as dist

from distributed.parallel_state import TPGroup


def agree_on_grammar_status(ready: set[int], failed: dict[int, str],
                            tp: TPGroup) -> tuple[set[int], dict[int, str]]:
    """ready = intersection over ranks, failed = union (the lowest rank's message wins).
    A request both ready somewhere and failed elsewhere is failed. No-op at size 1."""
    if tp.is_single:
        return ready - failed.keys(), failed
    gathered: list = [None] * tp.size
    dist.all_gather_object(gathered, (sorted(ready), failed), group=tp.cpu_group)
    agreed_failed: dict[int, str] = {}
    for _, rank_failed in gathered:  # rank order: deterministic messages
        for idx, message in rank_failed.items():
            agreed_failed.setdefault(idx, message)
    agreed_ready = set.intersection(*(set(r) for r, _ in gathered))
    return agreed_ready - agreed_failed.keys(), agreed_failed
