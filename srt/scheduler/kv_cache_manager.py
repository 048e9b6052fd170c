"""Turns scheduled requests into a ForwardBatch, allocating and freeing their KV slots.

Allocation is deterministic (same order, same free lists), so every rank of a TP group
holds the same slots for the same request without talking. With the radix cache, a
request's first ``prefix_len`` slots belong to the tree (shared, locked while it runs)
and the rest are its own until it ends, when they are inserted into the tree too.
"""
from __future__ import annotations

from typing import Optional

import torch

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode, mixed_batch
from srt.scheduler.req import Req
from srt.mem_cache.linear_state_pool import LinearStatePool
from srt.mem_cache.state_checkpoints import StateCheckpoints
from srt.scheduler.hybrid_state_cache import HybridStateCache
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt.mem_cache.prompt_logprob_pool import PromptLogprobPool
from srt.mem_cache.radix_cache import RadixCache
from srt.scheduler.prompt_logprob_cache import match_for_scoring, store_scored, take_cached


class KVCacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 kv_pool: MHATokenToKVPool, device: str, radix_cache: Optional[RadixCache] = None,
                 logprob_pool: Optional[PromptLogprobPool] = None,
                 state_pool: Optional[LinearStatePool] = None,
                 checkpoints: Optional[StateCheckpoints] = None):
        self.req_to_token_pool = req_to_token_pool
        # Hybrid models: the GDN layers' states, one slot per table row (rolled back by truncate),
        # and with the tree its state checkpoints (hybrid_state_cache.py).
        self.state_pool = state_pool
        self.states = HybridStateCache(radix_cache, checkpoints) if radix_cache and checkpoints else None
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.device = device
        self.tree = radix_cache
        # Prompt logprobs cached with the tree's slots (only with the tree).
        self.logprob_pool = logprob_pool if radix_cache is not None else None

    def available_tokens(self) -> int:
        """Free slots plus cached ones nobody is using (evicted on demand)."""
        return self.allocator.available_size() + (self.tree.evictable_size if self.tree else 0)

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.allocator.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)  # eviction before retraction: callers checked the budget
        out = self.allocator.alloc(n)
        assert out is not None, "KV allocation past the checked budget"
        if self.logprob_pool is not None:
            self.logprob_pool.reset(out)
        return out

    # ---- the prefix cache -------------------------------------------------------------
    def lock_prefix(self, req: Req) -> int:
        """A waiting request (no KV yet) takes the longest cached prefix of its tokens
        (leaving at least one to compute, for its logits; for prompt logprobs, every
        position whose logprob the cache does not hold) and locks it. Returns how many
        tokens stopped being evictable because of this lock."""
        if self.tree is None or req.req_pool_idx is not None:
            return 0
        if req.input_logprobs_done:
            end = -1
        elif self.logprob_pool is not None:
            end = match_for_scoring(req, self.tree, self.logprob_pool)
        else:  # prompt logprobs from position k need the logits of position k - 1
            end = max(req.logprob_start - 1, 0)
        slots, node = self.tree.match_prefix(req.fill_ids[:end])
        if self.states is not None:  # a hybrid model: only as far as a state checkpoint
            slots, node = self.states.limit_match(req, slots, node)
        req.prefix_slots, req.last_node = slots, node
        if req.cached_tokens is None:  # first admission: what the user is told was cached
            req.cached_tokens = min(len(slots), len(req.origin_input_ids))
        return self.tree.inc_lock_ref(node)

    def unlock_prefix(self, req: Req) -> None:
        """Undo ``lock_prefix`` for a request that was not admitted after all."""
        if req.last_node is not None and req.req_pool_idx is None:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node, req.prefix_slots = None, None
            req.cached_prompt_logprobs = None

    def prepare_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Prefill ``fill_ids`` beyond each request's cached prefix. Caller checked capacity."""
        ids, positions, prefix_lens, extend_lens, marks = [], [], [], [], []
        if self.states is not None:
            self.states.mark_shared_prefixes(reqs)
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = self.req_to_token_pool.alloc()
                if r.prefix_slots is not None and len(r.prefix_slots):
                    n = len(r.prefix_slots)
                    self.req_to_token_pool.req_to_token[r.req_pool_idx, :n] = r.prefix_slots
                    r.prefix_len = r.kv_committed_len = n
                    if self.states is not None:
                        self.states.admit(r)
                take_cached(r)
            fill = r.fill_ids
            start = r.kv_committed_len
            end = len(fill) if r.extend_limit is None else start + r.extend_limit
            if self.states is not None:
                marks.append(self.states.marks(r, start, end))
            ids.extend(fill[start:end])
            positions.extend(range(start, end))
            prefix_lens.append(start)
            extend_lens.append(end - start)
        out_loc = self._alloc(len(ids))
        assert all(r.req_pool_idx is not None for r in reqs)
        offset = 0
        table = self.req_to_token_pool.req_to_token
        for r, start, n in zip(reqs, prefix_lens, extend_lens):
            table[r.req_pool_idx, start:start + n] = out_loc[offset:offset + n]
            offset += n
            r.kv_committed_len = start + n
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        fb = self._batch(ForwardMode.EXTEND, reqs, ids, positions, out_loc, seq_lens,
                         extend_lens, prefix_lens)
        fb.state_marks = marks if any(marks) else None
        return fb

    def prepare_decode(self, reqs: list[Req]) -> ForwardBatch:
        """One step: feed each request's tokens without KV (``uncomputed_tokens``: its last
        output token, plus any the grammar fast-forwarded). A request with n such tokens
        takes n consecutive decode rows (same table row, positions p..p+n-1): every layer
        writes all rows' K/V before attending, and row i attends to positions <= its own,
        so the rows compute exactly a causal extend of those n tokens, inside the decode
        step (compiled graph included). Drafted tokens (speculative decoding) follow as
        more such rows; ``truncate`` frees the slots of those not accepted. Caller checked
        capacity."""
        counts = [r.decode_rows for r in reqs]
        total = sum(counts)
        out_loc = self._alloc(total)
        if total == len(reqs):
            positions = [r.kv_committed_len for r in reqs]
            table_rows = [r.req_pool_idx for r in reqs]
            ids = [r.output_ids[-1] for r in reqs]
        else:
            positions, table_rows, ids = [], [], []
            for r, n in zip(reqs, counts):
                positions.extend(range(r.kv_committed_len, r.kv_committed_len + n))
                table_rows.extend([r.req_pool_idx] * n)
                ids.extend(r.output_ids[-r.uncomputed_tokens:])
                ids.extend(r.draft_ids)
        rows = torch.tensor(table_rows, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self.req_to_token_pool.req_to_token[rows, pos_t] = out_loc
        for r, n in zip(reqs, counts):
            r.kv_committed_len += n
        seq_lens = [p + 1 for p in positions]
        return self._batch(ForwardMode.DECODE, reqs, ids, positions, out_loc, seq_lens,
                           [1] * total, positions, rows=rows, pos_t=pos_t)

    def prepare_mixed(self, decode_reqs: list[Req], extend_reqs: list[Req]) -> ForwardBatch:
        """The running requests' decode rows and the new requests' prefill in one forward
        (--enable-mixed-chunk); slots are taken in that order. Caller checked capacity."""
        return mixed_batch(self.prepare_decode(decode_reqs), self.prepare_extend(extend_reqs))

    def _batch(self, mode, reqs, ids, positions, out_loc, seq_lens, extend_lens, prefix_lens,
               rows=None, pos_t=None) -> ForwardBatch:
        dev = self.device
        if rows is None:
            rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
        if pos_t is None:
            pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=pos_t,
            out_cache_loc=out_loc,
            req_pool_indices=rows,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=prefix_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.kv_pool,
        )

    def truncate(self, req: Req, length: int) -> None:
        """Keep KV for the request's first ``length`` tokens only: the slots after them
        (drafted tokens that were not accepted) are freed at once and never cached."""
        if req.req_pool_idx is None or length >= req.kv_committed_len:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.allocator.free(row[length:req.kv_committed_len].clone())
        req.kv_committed_len = length
        if self.state_pool is not None:  # a hybrid model: the state after the last kept row
            self.state_pool.rollback(req.req_pool_idx, length)

    def release(self, req: Req) -> None:
        """A request ends (finish, abort, grammar failure) or is retracted: its computed
        tokens go into the tree (duplicates of cached ones are freed), its prefix lock is
        released, and its table row is freed. Without the tree, every slot is freed."""
        if req.req_pool_idx is None:
            return
        if self.tree is None:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self.allocator.free(row[:req.kv_committed_len].clone())
        else:
            self._insert(req, req.kv_committed_len)
            if req.last_node is not None:
                self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_committed_len = req.prefix_len = 0
        req.last_node = req.prefix_slots = None

    def cache_prefilled(self, req: Req) -> None:
        """Right after a request's prompt is prefilled, put it in the tree, so requests
        arriving while it still decodes share it (SGLang's cache_unfinished_req). Slots the
        tree already held for the same tokens replace the request's own copies."""
        if self.tree is None or req.req_pool_idx is None:
            return
        n, row = req.kv_committed_len, self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self._insert(req, n)
        tree_slots, node = self.tree.match_prefix(req.fill_ids[:n])
        row[:n] = tree_slots
        self.tree.inc_lock_ref(node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = node, n

    def _insert(self, req: Req, n: int) -> None:
        """Put the request's first ``n`` tokens in the tree; free its own slots for tokens
        the tree already held (computed again while another request cached them)."""
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].clone()
        cached = self.tree.insert(req.fill_ids[:n], slots)
        if cached > req.prefix_len:
            self.allocator.free(slots[req.prefix_len:cached])
        if self.states is not None:
            self.states.attach(req, n)
        if self.logprob_pool is not None and req.scored_until > req.logprobs_stored_until:
            store_scored(req, self.tree.peek(req.fill_ids[:n]), self.logprob_pool)

    def flush_cache(self) -> bool:
        """Empty the tree (POST /flush_cache); only when nothing holds a lock on it."""
        if self.tree is None:
            return True
        if self.tree.protected_size:
            return False
        if self.states is not None:
            self.states.flush()
        self.allocator.free(self.tree.all_slots())
        self.tree.reset()
        return True

    def check_idle_integrity(self) -> None:
        """With nothing running: free + cached == total, nothing locked, every row free."""
        free_tokens = self.allocator.available_size()
        cached = self.tree.total_size() if self.tree else 0
        locked = self.tree.protected_size if self.tree else 0
        free_rows = self.req_to_token_pool.available_size()
        if (free_tokens + cached != self.allocator.size or locked
                or free_rows != self.req_to_token_pool.size):
            raise RuntimeError(
                f"KV cache leak: {free_tokens} free + {cached} cached ({locked} locked) of "
                f"{self.allocator.size} token slots, {free_rows}/{self.req_to_token_pool.size} "
                "request rows free while idle")
        leak = self.states.leak() if self.states is not None else None
        if leak:
            raise RuntimeError(f"recurrent-state leak while idle: {leak}")
