"""Attention in plain torch over the token-level KV pool: the CPU backend (any device).

Decode reads one slot table per step, ``[B, S]`` (built once in
``init_forward_metadata``, not per layer; padding points at each sequence's first slot so
no never-written slot is read, and is masked). On CPU gramsync's own op reads each row's
keys and values in place through it (cpu_decode_attention.cpp: 0.84-0.99x the served
step of the path below, bf16 and fp32, docs/speed-history.md). The torch path, its reference and fallback,
gathers each layer's keys and values into a head-major ``[KVH, B, S, D]`` block with one
``index_select`` and runs two batched matmuls (GQA as grouped query heads, no repeat of
K/V); it beat Inductor's fused in-place loop (1.6 ms in place vs 0.47 ms at batch 32 x 100
keys, compiled, bf16, per layer). The table's key count is rounded up to
``DECODE_KEY_BUCKET`` so the matmul shapes repeat from step to step, and small batches
compute in fp32 (both measured in docs/speed-history.md).
Extend (prefill) runs SDPA per sequence: prompt lengths differ, torch has no varlen SDPA
on CPU, and a padded batch wastes the compute that dominates prefill; a sequence's loop
iteration costs microseconds next to its matmuls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention.base import AttentionBackend
from srt.layers.cpu_decode_attention_op import use_decode_attention_op


# Decode's key count S is rounded up to a multiple of this (the extra keys are masked):
# oneDNN JIT-compiles a bf16 matmul for every new shape (~0.6 ms; ~30 us once cached), and
# an S that grows by one each step made every step's first layer pay it (docs/speed-history.md).
DECODE_KEY_BUCKET = 64
# In a compiled step, up to this many rows (the small-batch graphs, compiled_decode.py)
# decode attention's two matmuls run in fp32 (MKL) rather than bf16 (oneDNN, ~55-70 us a
# call at these tiny shapes): the bf16 step 0.84-0.89x at 2-8 rows, 1.02x at 16
# (docs/speed-history.md). Eager, fp32 loses from 8 rows (its casts are separate ops), so there
# only one row computes in fp32.
FP32_ATTENTION_MAX_ROWS = 16


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode != ForwardMode.DECODE or fb.decode_kv_slots is not None:
            return
        width = fb.req_to_token_pool.req_to_token.shape[1]
        max_len = min(-(-max(fb.seq_lens_cpu) // DECODE_KEY_BUCKET) * DECODE_KEY_BUCKET, width)
        slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]  # [B, S]
        valid = torch.arange(max_len, device=slots.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        # Padding may point at never-written slots (torch.empty: NaN/inf garbage) and
        # 0 * NaN = NaN even after masking, so aim it at the sequence's first token.
        fb.decode_kv_slots = torch.where(valid, slots, slots[:, :1])
        fb.decode_kv_valid = valid

    # -- decode ---------------------------------------------------------------------
    def forward_decode(self, q: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        # A MIXED step's decode rows may bring a compiled kernel (compiled/prefill.py).
        kernel = fb.decode_attention or decode_attention
        return kernel(q, fb.token_to_kv_pool.k_buffer[layer.layer_id],
                      fb.token_to_kv_pool.v_buffer[layer.layer_id], fb.decode_kv_slots,
                      fb.decode_kv_valid, layer.num_kv_heads, layer.scaling)

    # -- prefill ----------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        k_buf = fb.token_to_kv_pool.k_buffer[layer.layer_id]
        v_buf = fb.token_to_kv_pool.v_buffer[layer.layer_id]
        req_to_token = fb.req_to_token_pool.req_to_token
        gqa = layer.num_heads != layer.num_kv_heads
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
                attn_mask=mask, is_causal=causal, scale=layer.scaling, enable_gqa=gqa)
            out[start:end] = o[0].transpose(0, 1)
            start = end
        return out


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                     valid: torch.Tensor, num_kv_heads: int, scaling: float) -> torch.Tensor:
    """q ``[B, H, D]`` against each row's keys (``slots``/``valid`` ``[B, S]``) in one
    layer's pool ``[KVH, N, D]``. No layer object: one compiled graph serves every layer.
    On CPU gramsync's own op reads the pool in place (cpu_decode_attention_op.py)."""
    if use_decode_attention_op(q, k_buf):
        return torch.ops.gramsync.decode_attention(q, k_buf, v_buf, slots, valid, scaling)
    return decode_attention_torch(q, k_buf, v_buf, slots, valid, num_kv_heads, scaling)


def decode_attention_torch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                           valid: torch.Tensor, num_kv_heads: int, scaling: float) -> torch.Tensor:
    """The torch path: gather, then two batched matmuls (and the op's reference)."""
    B, S = slots.shape
    H, D = q.shape[1], q.shape[2]
    KVH = num_kv_heads
    # fp32 matmuls (MKL, ~12 us a call) beat bf16's oneDNN calls at these tiny shapes. The
    # comparison is decided while tracing: each compiled graph's batch range lies wholly
    # on one side of it (docs/speed-history.md).
    fp32_rows = FP32_ATTENTION_MAX_ROWS if torch.compiler.is_compiling() else 1
    dtype = torch.float32 if B <= fp32_rows else q.dtype
    qg = q.view(B, KVH, H // KVH, D).transpose(0, 1).to(dtype)  # [KVH, B, G, D]
    flat = slots.reshape(-1)
    k = k_buf.index_select(1, flat).view(KVH, B, S, D).to(dtype)
    v = v_buf.index_select(1, flat).view(KVH, B, S, D).to(dtype)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scaling)  # [KVH, B, G, S]
    scores.masked_fill_(~valid.view(1, B, 1, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    out = torch.matmul(probs, v)  # [KVH, B, G, D]
    return out.to(q.dtype).transpose(0, 1).reshape(B, H, D)
