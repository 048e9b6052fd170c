"""Where a decode step fills its grammar bitmask: on a thread of its own while the forward
runs, or on the scheduler's thread just before sampling.

The overlap pays where the forward leaves a core idle (CUDA: the host waits on the device;
a CPU rank with more cores than torch threads). Where torch's threads already take every
core, the fill thread preempts one of them and the other waits at the next barrier: on a
2-vCPU EPYC at batch 1 a ~0.1 ms fill made the compiled forward 0.2-0.3 ms slower, more
than the fill itself costs in line (docs/speed.md, "Grammar masks at batch 1")."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch


def spare_cpu_cores() -> int:
    """Cores this process may run on beyond torch's intra-op threads."""
    return len(os.sched_getaffinity(0)) - torch.get_num_threads()


def mask_fill_executor(device: torch.device) -> Optional[ThreadPoolExecutor]:
    """The fill's thread, or None: fill in line (SamplingBatchInfo.update_regex_vocab_mask)."""
    if torch.device(device).type == "cpu" and spare_cpu_cores() < 1:
        return None
    return ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
