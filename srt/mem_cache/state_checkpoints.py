"""The radix cache's recurrent-state checkpoints for hybrid models: slots of the
LinearStatePool past the running requests' (ids ``running .. total - 1``).

A checkpoint is a copy of every GDN layer's conv and recurrent state at one token position
of one cached sequence, taken only where it is exact: during a prefill, at marked positions
(where the tree branches, and one token before the prompt's end so another sample of it can
compute its last token), and at the end of what a request computed when it is cached
(end of prefill, release). Allocation is deterministic (a stack), so every rank in lock-step
holds the same ids; when none is free, the least recently used unlocked one is taken back
from the tree, and if all are in use the checkpoint is simply not kept (fewer hits, never a
wrong state).
"""
from __future__ import annotations

from typing import Optional

from srt.mem_cache.linear_state_pool import LinearStatePool


class StateCheckpoints:
    def __init__(self, pool: LinearStatePool, first: int):
        self.pool = pool
        self.first = first
        self.capacity = pool.num_slots - first
        self._free = list(range(pool.num_slots - 1, first - 1, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert slot >= self.first, f"state slot {slot} is a running request's, not a checkpoint"
        self._free.append(slot)

    def copy(self, dst: int, src: int) -> None:
        """Every layer's conv and recurrent state of slot ``src`` into slot ``dst``."""
        self.pool.conv[:, dst] = self.pool.conv[:, src]
        self.pool.recurrent[:, dst] = self.pool.recurrent[:, src]
