"""The radix tree on its own: matching, splitting, insertion, locks, LRU eviction, digest."""
from __future__ import annotations

import random

import torch

from srt.mem_cache.radix_cache import RadixCache


def _cache():
    freed: list[int] = []
    return RadixCache(lambda t: freed.extend(t.tolist()), "cpu"), freed


def _slots(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_match_returns_the_longest_cached_prefix_and_splits_edges():
    c, _ = _cache()
    assert c.insert([1, 2, 3, 4], _slots(11, 12, 13, 14)) == 0
    slots, node = c.match_prefix([1, 2, 9])
    assert slots.tolist() == [11, 12] and node.key == [1, 2]  # the edge was split at 2
    assert c.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [11, 12, 13, 14]
    assert c.match_prefix([7])[0].numel() == 0
    assert c.evictable_size == 4 and c.protected_size == 0


def test_insert_reports_the_cached_part_and_keeps_only_new_slots():
    c, _ = _cache()
    c.insert([1, 2, 3], _slots(11, 12, 13))
    # Same first two tokens computed again elsewhere: 2 are duplicates for the caller to free.
    assert c.insert([1, 2, 5, 6], _slots(21, 22, 25, 26)) == 2
    assert c.match_prefix([1, 2, 5, 6])[0].tolist() == [11, 12, 25, 26]
    assert c.total_size() == 5


def test_locked_nodes_are_never_evicted_and_lru_goes_first():
    c, freed = _cache()
    c.insert([1, 2], _slots(1, 2))
    c.insert([3, 4], _slots(3, 4))
    c.insert([5, 6], _slots(5, 6))
    _, node = c.match_prefix([1, 2])  # [1,2] most recent; [3,4] least recent
    assert c.inc_lock_ref(node) == 2
    assert c.protected_size == 2 and c.evictable_size == 4
    c.match_prefix([5, 6])
    assert c.evict(1) == 2 and freed == [3, 4]  # whole leaf, least recently used
    assert c.evict(10) == 2 and freed == [3, 4, 5, 6]  # the locked one stays
    assert c.match_prefix([1, 2])[0].tolist() == [1, 2]
    c.dec_lock_ref(node)
    assert c.evict(10) == 2 and c.total_size() == 0


def test_eviction_climbs_to_parents_that_become_leaves():
    c, freed = _cache()
    c.insert([1, 2, 3], _slots(1, 2, 3))
    c.insert([1, 2, 4], _slots(1, 2, 4))  # splits: [1,2] -> {[3], [4]}
    assert c.evict(5) == 4 and sorted(freed) == [1, 2, 3, 4]
    assert c.total_size() == 0 and c.root.children == {}


def test_lock_counts_nest_and_survive_splits():
    c, _ = _cache()
    c.insert([1, 2, 3, 4], _slots(1, 2, 3, 4))
    _, deep = c.match_prefix([1, 2, 3, 4])
    c.inc_lock_ref(deep)
    _, mid = c.match_prefix([1, 2])  # splits the locked edge: the upper half inherits the lock
    assert c.inc_lock_ref(mid) == 0 and c.protected_size == 4
    c.dec_lock_ref(deep)
    assert c.protected_size == 2 and c.evictable_size == 2
    c.dec_lock_ref(mid)
    assert c.protected_size == 0 and c.evictable_size == 4


def test_flush_returns_every_slot():
    c, _ = _cache()
    c.insert([1, 2, 3], _slots(1, 2, 3))
    c.insert([1, 9], _slots(1, 9))
    assert sorted(c.all_slots().tolist()) == [1, 2, 3, 9]
    c.reset()
    assert c.total_size() == 0 and c.match_prefix([1])[0].numel() == 0


def test_same_operations_give_the_same_digest_and_different_ones_do_not():
    def run(seed):
        c, _ = _cache()
        rng = random.Random(seed)
        for i in range(60):
            key = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            c.insert(key, torch.arange(100 * i, 100 * i + len(key)))
            if i % 7 == 0:
                c.evict(5)
        return c.digest()

    assert run(1) == run(1)
    assert run(1) != run(2)
