"""RadixAttention's prefix cache: a radix tree over token ids whose nodes own KV slots.

A finished (or aborted, or retracted) request inserts its tokens and their KV slots; a
new request that starts with cached tokens reuses their slots and prefills only the rest.
Nodes used by running requests are locked (a reference count up to the root); when the
allocator runs short, unlocked leaves are evicted least recently used first.

Lock-step: every operation is a pure function of the request stream all ranks agree on.
"Recently used" is a logical clock ticked per operation, never wall time, and ties break
by node creation order, so every TP rank holds the same tree and evicts the same nodes;
``digest()`` lets a test (and the batch log) check that.

Hybrid models (Gated DeltaNet): a node may also hold a recurrent-state checkpoint (``state``:
a slot of the LinearStatePool) - the state after the node's last token, stored only where it
is exact. KV alone is useless to such a model, so its matches stop at the deepest node with a
checkpoint (``deepest_checkpoint``). Splitting an edge keeps the state on the lower node (it
still ends where the state does); evicting a node frees its checkpoint; checkpoints have their
own budget (``evict_state``).
"""
from __future__ import annotations

import hashlib
import heapq
from typing import Callable, Optional

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "node_id", "state")

    def __init__(self, node_id: int, parent: Optional["TreeNode"], key: list[int],
                 value: torch.Tensor, clock: int):
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent
        self.key = key  # token ids on the edge into this node
        self.value = value  # their KV slots, int64, same length as key
        self.lock_ref = 0
        self.last_access = clock
        self.node_id = node_id
        self.state: Optional[int] = None  # hybrid models: the state checkpoint's slot


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, free_slots: Callable[[torch.Tensor], None], device: str,
                 free_state: Optional[Callable[[int], None]] = None):
        """``free_slots(indices)`` returns evicted KV slots to the allocator;
        ``free_state(slot)`` an evicted node's state checkpoint (hybrid models)."""
        self.free_slots = free_slots
        self.free_state = free_state
        self.device = device
        self.evicted_tokens = 0  # since start (flushes not counted): for logs and tests
        self.reset()

    def reset(self) -> None:
        """Forget everything (the caller frees the slots first: see ``all_slots``)."""
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node(None, [], torch.empty(0, dtype=torch.int64, device=self.device))
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in nodes locked by running requests

    def _new_node(self, parent, key, value) -> TreeNode:
        node = TreeNode(self._next_id, parent, key, value, self._clock)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- lookup and insertion ---------------------------------------------------------
    def _walk(self, key: list[int]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``key`` down the tree, splitting the edge where it diverges, touching
        every node on the way; returns the deepest node, tokens matched, their slots."""
        node, values, pos, now = self.root, [], 0, self._tick()
        node.last_access = now
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            n = _common_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            pos += n
            node = child
        return node, pos, values

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The KV slots of the longest cached prefix of ``key`` and the node it ends at
        (split if the match ends inside an edge, so the node covers exactly the match)."""
        node, _, values = self._walk(key)
        return (torch.cat(values) if values else self.root.value), node

    def peek(self, key: list[int]) -> torch.Tensor:
        """The KV slots of the longest cached prefix of ``key``, changing nothing (no
        split, no access time): for looking at what a match would give."""
        node, values, pos = self.root, [], 0
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            n = _common_len(child.key, key[pos:pos + len(child.key)])
            values.append(child.value[:n])
            pos += n
            if n < len(child.key):
                break
            node = child
        return torch.cat(values) if values else self.root.value

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        upper = self._new_node(child.parent, child.key[:n], child.value[:n])
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:]
        return upper

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Cache ``key`` with slots ``value``; returns how many leading tokens were already
        cached (their slots in ``value`` are duplicates the caller must free)."""
        node, pos, _ = self._walk(key)
        if pos < len(key):
            leaf = self._new_node(node, key[pos:], value[pos:].clone())
            node.children[key[pos]] = leaf
            self.evictable_size += len(leaf.key)
        return pos

    # ---- locks ------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors; returns the tokens that became protected."""
        newly = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                newly += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return newly

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix cache lock released twice"
            node = node.parent

    # ---- eviction ---------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used
        first (ties: oldest node); returns how many were freed."""
        heap = [(n.last_access, n.node_id, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.free_slots(leaf.value)
            if leaf.state is not None:  # the state below evicted KV goes with it
                self.free_state(leaf.state)
                leaf.state = None
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            self.evicted_tokens += len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    # ---- state checkpoints (hybrid models) ----------------------------------------------
    def deepest_checkpoint(self, node: TreeNode) -> tuple[TreeNode, int]:
        """The nearest node at or above ``node`` that holds a state checkpoint (the root,
        depth 0, if none) and its depth in tokens."""
        while node is not self.root and node.state is None:
            node = node.parent
        depth, up = 0, node
        while up is not self.root:
            depth += len(up.key)
            up = up.parent
        return node, depth

    def state_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.state is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def evict_state(self) -> Optional[int]:
        """Take the least recently used checkpoint of an unlocked node (ties: oldest node)
        off its node and return its slot; None when every checkpoint is in use."""
        nodes = [n for n in self.state_nodes() if n.lock_ref == 0]
        if not nodes:
            return None
        node = min(nodes, key=lambda n: (n.last_access, n.node_id))
        slot, node.state = node.state, None
        return slot

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for a flush: free these, then ``reset``)."""
        values, stack = [], [self.root]
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        return torch.cat(values)

    def digest(self) -> str:
        """A hash of the whole tree (keys, slots, locks), equal on ranks in lock-step."""
        h, stack = hashlib.sha256(), [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            h.update(repr((depth, node.key, node.value.tolist(), node.lock_ref)).encode())
            if node.state is not None:  # hybrid models: the checkpoints too
                h.update(repr(("state", node.state)).encode())
            stack.extend((node.children[t], depth + 1) for t in sorted(node.children, reverse=True))
        return h.hexdigest()[:16]
