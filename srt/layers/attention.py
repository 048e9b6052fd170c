"""Paged attention over the token-level KV pool, in plain torch (CPU and GPU).

The layer writes the new tokens' K/V into ``fb.token_to_kv_pool`` at ``fb.out_cache_loc``
and then attends:
- EXTEND: per sequence (prefill is compute-bound, so one loop iteration per sequence is
  cheap next to its matmuls): causal SDPA over the new tokens alone when nothing is cached,
  otherwise SDPA over prefix + new keys gathered through ``req_to_token``;
- DECODE: batched over sequences and heads, no per-sequence Python. K/V of all
  sequences are gathered from the head-major pool, padded to the longest one, as
  ``[KVH, B, S, D]``; query heads are grouped ``[KVH, B, G, D]`` so GQA is one batched
  matmul against the shared KV head (no repeat of K/V).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.forward_batch import ForwardBatch, ForwardMode


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, layer_id: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q ``[T, H*D]``, k/v ``[T, KVH*D]`` -> ``[T, H*D]``."""
        T, D = q.shape[0], self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        fb.token_to_kv_pool.set_kv(self.layer_id, fb.out_cache_loc, k, v)
        if fb.mode == ForwardMode.DECODE:
            out = self._decode(q, fb)
        else:
            out = self._extend(q, k, v, fb)
        return out.reshape(T, self.num_heads * D)

    # -- prefill ----------------------------------------------------------------------
    def _extend(self, q, k, v, fb: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        k_buf = fb.token_to_kv_pool.k_buffer[self.layer_id]
        v_buf = fb.token_to_kv_pool.v_buffer[self.layer_id]
        req_to_token = fb.req_to_token_pool.req_to_token
        start = 0
        for i, (n_new, n_prefix) in enumerate(zip(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)):
            end = start + n_new
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
            if n_prefix == 0:
                ki, vi, mask, causal = k[start:end], v[start:end], None, True
            else:
                slots = req_to_token[fb.req_pool_indices[i], : n_prefix + n_new]
                ki = k_buf.index_select(1, slots).transpose(0, 1)  # [n, KVH, D]
                vi = v_buf.index_select(1, slots).transpose(0, 1)
                # New token j sits at absolute position n_prefix + j; it sees keys <= that.
                rows = torch.arange(n_new, device=q.device).unsqueeze(1) + n_prefix
                mask = torch.arange(n_prefix + n_new, device=q.device).unsqueeze(0) <= rows
                causal = False
            o = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out

    # -- decode ---------------------------------------------------------------------
    def _decode(self, q, fb: ForwardBatch) -> torch.Tensor:
        B, KVH, D = q.shape[0], self.num_kv_heads, self.head_dim
        G = self.num_heads // KVH
        max_len = max(fb.seq_lens_cpu)
        slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]  # [B, S]
        valid = torch.arange(max_len, device=q.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        # Padding positions may point at never-written slots (torch.empty: NaN/inf garbage)
        # and 0 * NaN = NaN even after masking, so aim them at the sequence's first token.
        slots = torch.where(valid, slots, slots[:, :1]).reshape(-1)
        # The pool is head-major, so this gather is already [KVH, B, S, D], contiguous:
        # the matmuls below read it in place (no per-head copies, one call for all heads).
        k = fb.token_to_kv_pool.k_buffer[self.layer_id].index_select(1, slots).view(KVH, B, max_len, D)
        v = fb.token_to_kv_pool.v_buffer[self.layer_id].index_select(1, slots).view(KVH, B, max_len, D)
        qg = q.view(B, KVH, G, D).transpose(0, 1)  # query head h uses KV head h // G
        scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(self.scaling)  # [KVH, B, G, S]
        scores.masked_fill_(~valid.view(1, B, 1, max_len), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out = torch.matmul(probs, v)  # [KVH, B, G, D]
        return out.transpose(0, 1).reshape(B, self.num_heads, D)
