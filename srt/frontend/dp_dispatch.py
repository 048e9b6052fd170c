"""Which DP group (an independent TP group) serves a new request.

The frontend is the only place that sees every request, so it keeps the per-group count
of requests in flight itself; no message from the schedulers is needed.

``prefix_aware`` (SGLang's router calls it cache-aware) sends a request to the group most
likely to hold its prefix in its radix cache. The frontend cannot see the groups' trees,
so it keeps its own approximation: one token tree per group of the prompts it routed
there (``RadixCache`` with no KV behind it), trimmed least recently used first. A request
whose longest match covers at least ``match_threshold`` of its tokens goes to that group,
unless that group is busier than the least busy one by more than ``balance_slack``
requests; otherwise it goes to the shortest queue.
"""
from __future__ import annotations

from typing import Optional, Sequence


class DPDispatcher:
    METHODS = ("round_robin", "shortest_queue", "prefix_aware")

    def __init__(self, dp_size: int, method: str = "round_robin", *, match_threshold: float = 0.5,
                 balance_slack: int = 8, max_tree_tokens: int = 1 << 20):
        if method not in self.METHODS:
            raise ValueError(f"Unknown load balance method {method!r}; use one of {self.METHODS}")
        self.method = method
        self.in_flight = [0] * dp_size
        self._next = 0
        self.match_threshold, self.balance_slack = match_threshold, balance_slack
        self.max_tree_tokens = max_tree_tokens
        self.trees = _token_trees(dp_size) if method == "prefix_aware" else []
        self.groups: dict[str, tuple[int, int]] = {}  # group -> (its DP group, requests in flight)
        self.prefix_routed = 0  # requests sent where their prefix was (for metrics and tests)

    def pick(self, token_ids: Optional[Sequence[int]] = None, group: Optional[str] = None) -> int:
        """The group for the next request; counts it as in flight there. Requests with the
        same ``group`` (the samples of one prompt) go where its first one went."""
        if group is not None and group in self.groups:
            dp, count = self.groups[group]
            self.groups[group] = (dp, count + 1)
            self.in_flight[dp] += 1
            return dp
        if self.method == "round_robin":
            dp = self._next
            self._next = (self._next + 1) % len(self.in_flight)
        elif self.method == "prefix_aware" and token_ids:
            dp = self._pick_by_prefix(list(token_ids))
        else:
            dp = self._shortest()
        self.in_flight[dp] += 1
        if group is not None:
            self.groups[group] = (dp, 1)
        return dp

    def _shortest(self) -> int:  # fewest in flight; ties go to the lowest group
        return min(range(len(self.in_flight)), key=self.in_flight.__getitem__)

    def _pick_by_prefix(self, ids: list[int]) -> int:
        matches = [len(tree.match_prefix(ids)[0]) for tree in self.trees]
        best = max(range(len(matches)), key=lambda d: (matches[d], -self.in_flight[d]))
        shortest = self._shortest()
        if (matches[best] >= self.match_threshold * len(ids)
                and self.in_flight[best] - self.in_flight[shortest] <= self.balance_slack):
            dp = best
            self.prefix_routed += 1
        else:
            dp = shortest
        tree = self.trees[dp]
        tree.insert(ids, tree.root.value.new_zeros(len(ids)))
        if tree.total_size() > self.max_tree_tokens:
            tree.evict(tree.total_size() - self.max_tree_tokens)
        return dp

    def done(self, dp: int, group: Optional[str] = None) -> None:
        self.in_flight[dp] -= 1
        if group is not None and group in self.groups:
            dp, count = self.groups[group]
            if count > 1:
                self.groups[group] = (dp, count - 1)
            else:
                del self.groups[group]


def _token_trees(dp_size: int) -> list:
    """One KV-less ``RadixCache`` per group. Imported here: the radix cache holds torch
    tensors, and the frontend loads torch only when it routes by prefix."""
    from srt.mem_cache.radix_cache import RadixCache

    return [RadixCache(lambda slots: None, "cpu") for _ in range(dp_size)]
