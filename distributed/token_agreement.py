"""The agreement point for sampled tokens: when a batch holds grammars, every rank of the
TP group must feed the same token into its grammar matchers, or their masks (and then
their batches) drift apart. SGLang takes the element-wise minimum over the group; so do we.

Logits are all-gathered (identical bytes on every rank) and seeded sampling draws the
same numbers everywhere, so the ids already agree in practice; ``mismatches`` counts the
rows where they did not, so that claim is measured, not assumed.

Why this shape (benchmark/bench_grammar_sync.py times the alternatives): the device group,
because the ids are on the device (NCCL on GPU, no copy; on CPU shared memory where the
group shares a machine, distributed/shm_collectives.py, else gloo, as fast as the CPU group); int64, the sampler's dtype (int32 measured no faster: at these sizes gloo
pays per message, not per byte). An all_gather + local min (exact too) is no faster at
TP=2 and slower for 1-2 ids; only with 4 ranks on 2 CPUs was it faster (half the ring
steps, so fewer scheduler stalls): not adopted until measured with a core per rank.

Not folded into another collective: the logits all-gather precedes sampling, and the next
collectives (request broadcast, grammar agreement) come after the grammars must already
have accepted the token -- moving the agreement there would change the step a token
takes effect in.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distributed.parallel_state import TPGroup


def agree_on_sampled_ids(ids: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, int]:
    """``(agreed_ids, mismatches)``: element-wise MIN over the TP group, and how many of
    this rank's ids differed from it. No-op at group size 1."""
    if tp.is_single:
        return ids, 0
    agreed = ids.clone()
    if tp.shm is None or not tp.shm.all_reduce(agreed, op="min"):
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.device_group)
    return agreed, int((agreed != ids).sum().item())
