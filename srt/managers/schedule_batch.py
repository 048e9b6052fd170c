"""Turns scheduled requests into a ForwardBatch, allocating and freeing their KV slots.

Allocation is deterministic (same order, same free lists), so every rank of a TP group
holds the same slots for the same request without talking.
"""
from __future__ import annotations

import torch

from srt.forward_batch import ForwardBatch, ForwardMode
from srt.managers.req import Req
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator


class KVCacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 kv_pool: MHATokenToKVPool, device: str):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.device = device

    def available_tokens(self) -> int:
        return self.allocator.available_size()

    def prepare_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Prefill ``fill_ids`` beyond each request's cached prefix. Caller checked capacity."""
        ids, positions, prefix_lens, extend_lens = [], [], [], []
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = self.req_to_token_pool.alloc()
            fill = r.fill_ids
            start = r.kv_committed_len
            ids.extend(fill[start:])
            positions.extend(range(start, len(fill)))
            prefix_lens.append(start)
            extend_lens.append(len(fill) - start)
        out_loc = self.allocator.alloc(len(ids))
        assert out_loc is not None and all(r.req_pool_idx is not None for r in reqs)
        offset = 0
        table = self.req_to_token_pool.req_to_token
        for r, start, n in zip(reqs, prefix_lens, extend_lens):
            table[r.req_pool_idx, start:start + n] = out_loc[offset:offset + n]
            offset += n
            r.kv_committed_len = start + n
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        return self._batch(ForwardMode.EXTEND, reqs, ids, positions, out_loc, seq_lens,
                           extend_lens, prefix_lens)

    def prepare_decode(self, reqs: list[Req]) -> ForwardBatch:
        """One step: feed each request's last output token. Caller checked capacity."""
        out_loc = self.allocator.alloc(len(reqs))
        assert out_loc is not None
        positions = [r.kv_committed_len for r in reqs]
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        self.req_to_token_pool.req_to_token[rows, pos_t] = out_loc
        for r in reqs:
            r.kv_committed_len += 1
        seq_lens = [p + 1 for p in positions]
        ids = [r.output_ids[-1] for r in reqs]
        return self._batch(ForwardMode.DECODE, reqs, ids, positions, out_loc, seq_lens,
                           [1] * len(reqs), positions, rows=rows, pos_t=pos_t)

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

    def release(self, req: Req) -> None:
        """Free a request's KV slots and table row (finish, abort or retraction)."""
        if req.req_pool_idx is None:
            return
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_committed_len]
        self.allocator.free(slots.clone())
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_committed_len = 0

    def check_idle_integrity(self) -> None:
        """With nothing running, every slot must be free (free + used == total)."""
        free_tokens = self.allocator.available_size()
        free_rows = self.req_to_token_pool.available_size()
        if free_tokens != self.allocator.size or free_rows != self.req_to_token_pool.size:
            raise RuntimeError(
                f"KV cache leak: {free_tokens}/{self.allocator.size} token slots and "
                f"{free_rows}/{self.req_to_token_pool.size} request rows free while idle")
