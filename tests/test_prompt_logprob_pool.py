"""The prompt-logprob pool with the real radix cache and KV manager, without a model:
entries round-trip bit for bit, a match serves exactly what an earlier request scored,
eviction frees entries with their slots, and a rank holding no numbers (not the entry
rank) makes the same decisions as the one holding them.

The "model" is a stand-in: each position's logits are a pure function of the tokens up to
it (seeded by them), as a real model's are, so a recomputation gives the same numbers.
"""
from __future__ import annotations

import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt.mem_cache.prompt_logprob_pool import PromptLogprobPool
from srt.mem_cache.radix_cache import RadixCache
from srt.scheduler.kv_cache_manager import KVCacheManager
from srt.scheduler.logprob_tracker import plan_prompt_logprobs, record_prompt_logprobs
from srt.scheduler.prompt_logprob_cache import RECOMPUTE_ROWS
from srt.scheduler.req import Req
from sampling.sampling_params import SamplingParams
from srt.transport.io_struct import LogprobRequest

VOCAB = 256


def _manager(size: int, holds_values: bool) -> KVCacheManager:
    alloc = TokenToKVPoolAllocator(size, "cpu")
    return KVCacheManager(ReqToTokenPool(4, 256, "cpu"), alloc, MHATokenToKVPool(size, 1, 1, 4, torch.float32, "cpu"),
                          "cpu", RadixCache(alloc.free, "cpu"), PromptLogprobPool(size, 20, holds_values))


def _logits(prompt: list[int], rows: list[int], positions: list[int]) -> torch.Tensor:
    out = []
    for p in positions:
        g = torch.Generator().manual_seed(hash(tuple(prompt[:p + 1])) % 2**31)
        out.append(torch.randn(VOCAB, generator=g))
    return torch.stack(out) if out else torch.empty(0, VOCAB)


def _score(kv: KVCacheManager, prompt: list[int], top: int, start: int = 0, compute: bool = True) -> Req:
    """One request through lock, prefill (one step), prompt logprobs and release."""
    req = Req("r", tuple(prompt), SamplingParams(max_new_tokens=0), False, frozenset(),
              logprobs=LogprobRequest(top_n=top, start_len=start))
    kv.lock_prefix(req)
    fb = kv.prepare_extend([req])
    rows, plan = plan_prompt_logprobs([req], fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
    begin = fb.extend_prefix_lens_cpu[0]
    extra_positions = [begin + r for r in rows[1:]]  # row 0: the sequence's last
    record_prompt_logprobs(plan, _logits(prompt, rows, extra_positions), compute)
    assert req.input_logprobs_done
    kv.release(req)
    return req


def test_entries_round_trip_bit_for_bit_with_short_tops():
    pool = PromptLogprobPool(8, 4, holds_values=True)
    slots = torch.tensor([3, 5])
    entries = [(-0.1234567, ((7, -0.1234567), (2, -2.5))), (-1e-8, ((1, -1e-8),))]
    entries = [(float(torch.tensor(lp)), tuple((t, float(torch.tensor(v))) for t, v in top))
               for lp, top in entries]  # float32 values, as the sampler's tolist() gives
    pool.write(slots, 2, entries)
    assert pool.counts(slots).tolist() == [2, 2] and pool.counts(torch.tensor([4])).tolist() == [-1]
    assert pool.read(slots, 2) == entries
    assert pool.read(slots, 1) == [(lp, top[:1]) for lp, top in entries]
    pool.reset(torch.tensor([5]))
    assert pool.counts(slots).tolist() == [2, -1]
    assert PromptLogprobPool.bytes_per_token(20) == 165


def test_a_match_serves_what_was_scored_and_eviction_frees_it():
    kv = _manager(200, holds_values=True)
    ctx = list(range(1, 61))
    a = _score(kv, ctx + [7, 8], top=3)
    b = _score(kv, ctx + [9], top=2)
    assert b.cached_tokens == len(ctx) - RECOMPUTE_ROWS
    served = len(ctx) - RECOMPUTE_ROWS + 1
    assert b.input_token_logprobs[:served] == a.input_token_logprobs[:served]
    assert b.input_top_logprobs[1:served] == [t[:2] for t in a.input_top_logprobs[1:served]]
    fresh = _score(_manager(200, True), ctx + [9], top=2)
    assert b.input_token_logprobs == fresh.input_token_logprobs  # the stand-in is exact
    again = _score(kv, ctx + [9], top=2)  # the whole prompt is cached now
    assert again.cached_tokens == len(ctx) and again.input_token_logprobs == fresh.input_token_logprobs
    # More alternatives than kept: computed again, from the start.
    assert _score(kv, ctx + [9], top=4).cached_tokens == 0
    # Evicted: the slots come back empty, and nothing is served.
    kv.tree.evict(10**6)
    assert kv.tree.total_size() == 0
    kv._alloc(kv.allocator.available_size())  # every slot reused: all entries reset
    assert (kv.logprob_pool.top_count[1:] == -1).all()
    kv.allocator.free(torch.arange(1, 201))
    assert _score(kv, ctx + [9], top=2).cached_tokens == 0


def test_a_rank_without_the_numbers_decides_the_same():
    """Only the entry rank holds values; every rank must lock the same prefixes."""
    ranks = [_manager(300, holds_values=True), _manager(300, holds_values=False)]
    ctx = list(range(100, 180))
    plan = [(ctx + [1, 2], 1, 0), (ctx + [3], 1, 0), (ctx + [3], 5, 0), (ctx[:50] + [4] * 30, 0, 20),
            (ctx + [5], 0, 40)]
    seen = []
    for kv in ranks:
        out = [_score(kv, p, top, start, compute=kv.logprob_pool.holds_values) for p, top, start in plan]
        seen.append(([r.cached_tokens for r in out], [r.scored_until for r in out], kv.tree.digest(),
                     kv.logprob_pool.top_count.tolist()))
    assert seen[0] == seen[1]
    assert seen[0][0][1] > 0 and seen[0][0][2] == 0  # served; then more alternatives: computed
