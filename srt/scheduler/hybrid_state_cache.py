"""The radix cache's side for hybrid models: recurrent-state checkpoints on tree nodes.

KVCacheManager calls it where the tree is used (mem_cache/state_checkpoints.py says where a
checkpoint is exact):
- ``limit_match``: a match stops at the deepest node with a checkpoint (KV without the state
  at its end is useless); the positions worth checkpointing on this request's prefill are
  noted: where its KV match ended (the tree branches there) and one token before its end;
- ``admit``: the matched checkpoint is copied into the request's own slot;
- ``marks``: checkpoint slots for the marked positions inside a prefill chunk, and for the
  chunk's end when the prompt goes on (chunked prefill) and a slot is free;
- ``attach``: once the request's tokens are in the tree, its checkpoints go on their nodes,
  and so does the state at the end of what it computed (its slot, exact there).
"""
from __future__ import annotations

import torch

from srt.mem_cache.radix_cache import RadixCache, TreeNode
from srt.mem_cache.state_checkpoints import StateCheckpoints
from srt.scheduler.req import Req


class HybridStateCache:
    def __init__(self, tree: RadixCache, checkpoints: StateCheckpoints):
        self.tree, self.checkpoints = tree, checkpoints

    def limit_match(self, req: Req, slots: torch.Tensor, node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        kv_match, total = len(slots), len(req.fill_ids)
        node, depth = self.tree.deepest_checkpoint(node)
        req.state_marks = sorted({m for m in (kv_match, total - 1) if depth < m < total})
        return slots[:depth], node

    @staticmethod
    def mark_shared_prefixes(reqs: list[Req]) -> None:
        """Requests prefilled together that share a prefix (a system prompt reaching the cache
        in a burst): each also checkpoints where it parts from the others, so the next request
        with that prefix hits it. Neighbours in sorted order have the longest common prefixes."""
        if len(reqs) < 2:
            return
        order = sorted(reqs, key=lambda r: r.fill_ids)
        for a, b in zip(order, order[1:]):
            n = _common_prefix_len(a.fill_ids, b.fill_ids)
            for r in (a, b):
                if r.kv_committed_len < n < len(r.fill_ids) and n not in r.state_marks:
                    r.state_marks = sorted(r.state_marks + [n])

    def admit(self, req: Req) -> None:
        """A new row with a cached prefix: its slot starts from the prefix's checkpoint."""
        self.checkpoints.copy(req.req_pool_idx, req.last_node.state)

    def _alloc(self) -> int | None:
        slot = self.checkpoints.alloc()
        return slot if slot is not None else self.tree.evict_state()

    def marks(self, req: Req, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """(offset in the chunk, checkpoint slot) for the marked positions inside ``(start, end)``."""
        out = []
        for m in req.state_marks:
            if start < m < end and (slot := self._alloc()) is not None:
                req.pending_checkpoints.append((m, slot))
                out.append((m - start, slot))
        req.state_marks = [m for m in req.state_marks if m >= end]
        # A chunk of a longer prompt: its end too, while a slot is free (never evicting for it).
        if end < len(req.fill_ids) and (slot := self.checkpoints.alloc()) is not None:
            req.pending_checkpoints.append((end, slot))
            out.append((end - start, slot))
        return tuple(out)

    def _node_at(self, key: list[int]) -> TreeNode:
        _, node = self.tree.match_prefix(key)  # split there: the node ends at len(key)
        return node

    def attach(self, req: Req, n: int) -> None:
        """After the request's first ``n`` tokens went into the tree."""
        for pos, slot in req.pending_checkpoints:
            node = self._node_at(req.fill_ids[:pos]) if pos <= n else None
            if node is not None and node.state is None:
                node.state = slot
            else:  # another request's checkpoint is there already
                self.checkpoints.free(slot)
        req.pending_checkpoints = []
        if n == 0:
            return
        node = self._node_at(req.fill_ids[:n])
        if node.state is None and (slot := self._alloc()) is not None:
            self.checkpoints.copy(slot, req.req_pool_idx)
            node.state = slot

    def flush(self) -> None:
        for node in self.tree.state_nodes():
            self.checkpoints.free(node.state)
            node.state = None

    def leak(self) -> str | None:
        held = len(self.tree.state_nodes())
        if held + self.checkpoints.available() != self.checkpoints.capacity:
            return (f"state checkpoints: {held} in the tree + {self.checkpoints.available()} free "
                    f"of {self.checkpoints.capacity}")
        return None


def _common_prefix_len(a, b) -> int:
    """Binary search on slice equality: O(n log n) element compares, all in C."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
