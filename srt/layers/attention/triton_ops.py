"""Triton attention kernels over the token-level paged KV pool (decode and extend/prefill).

Layout. Per layer the pool holds ``k_buffer`` / ``v_buffer`` of shape
``[num_kv_heads, pool_size + 1, head_dim]`` (slot 0 is a dummy padding slot). Kernels
take every stride explicitly, so a token-major pool viewed as ``buf.transpose(0, 1)``
works unchanged. ``req_to_token[req_pool_indices[b], p]`` is the slot of sequence b's
token at position p; keys are read in place through that table, never gathered into a
copy. GQA: query head h reads kv head ``h // (num_heads // num_kv_heads)``.

Algorithm: FlashAttention-style online softmax with fp32 statistics. Keys are visited in
blocks of BLOCK_N; per block the scores s are formed, the running max m is raised, the
accumulator and the running sum l are rescaled by exp(m_old - m_new), and
exp(s - m_new) @ V is added; the output is acc / l. Scores are pre-multiplied by
``scale * log2(e)`` so that exp2 (one GPU instruction) stands in for exp.

- decode (one query token per sequence) is memory-bound, so it is split-K
  ("flash-decoding"). Stage 1 runs on a (sequence, kv head, split) grid: each program
  serves all query heads of one kv head, so K/V are loaded once per GQA group rather than
  once per query head, over one slice of the keys, and writes its partial output
  o_i = acc_i / l_i with its log-sum-exp lse_i. Stage 2 merges the splits:
  out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M). Split bounds are computed from
  ``seq_lens`` on the device: no host sync, and the grid depends on the batch size only
  (CUDA-graph friendly).
- extend runs on a (sequence, query block, head) grid. New token j of sequence b sits at
  absolute position prefix_lens[b] + j and sees keys at positions <= that; a query block
  stops its key loop after the last key its last row can see (causal block skipping).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(q, acc, m_i, l_i, K, V, row, pos, in_seq, valid, max_context, offs_d, d_mask,
                  stride_rp, stride_ks, stride_kd, stride_vs, stride_vd, qk_scale, UPCAST: tl.constexpr):
    """One online-softmax step of q's rows against the keys at positions ``pos`` [BLOCK_N]
    of the table row ``row``. ``in_seq`` [BLOCK_N] marks real keys, ``valid`` [rows, BLOCK_N]
    the ones each row may see. Every row sees >= 1 key in its first block, so m_i is finite
    from then on and exp2(-inf - -inf) never happens."""
    # Keys outside the sequence load slot -1 and then no K/V; the column bound keeps a bad
    # length from reading past the table.
    slots = tl.load(row + pos * stride_rp, mask=in_seq & (pos < max_context), other=-1).to(tl.int64)
    kv_mask = (slots >= 0)[:, None] & d_mask[None, :]
    k = tl.load(K + slots[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + slots[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if UPCAST:  # interpreter only: its tl.dot multiplies bf16 bit patterns (triton#11584)
        k = k.to(tl.float32)
    # "ieee" only matters for fp32 pools, which are for exactness (tf32 loses ~3 digits).
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    p_lo = p.to(v.dtype)  # P @ V on the tensor cores in the pool's dtype, as FlashAttention does
    if UPCAST:
        p_lo, v = p_lo.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_lo, v, input_precision="ieee")
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _decode_split_kernel(Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, qk_scale,
                         stride_qb, stride_qh, stride_qd, stride_kh, stride_ks, stride_kd,
                         stride_vh, stride_vs, stride_vd, stride_rr, stride_rp, max_context,
                         num_heads, group_size, head_dim, num_splits, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    blocks_per_group = tl.cdiv(group_size, BLOCK_H)  # > 1 only for groups of > BLOCK_H heads
    kv_head = tl.program_id(1) // blocks_per_group
    in_group = (tl.program_id(1) % blocks_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = in_group < group_size
    heads = kv_head * group_size + in_group
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    # Splits are whole blocks long, so only a sequence's last block is partial, and short
    # sequences use the first splits only (the others just store an empty result).
    seq_len = tl.load(SeqLens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_rr

    # tl.dot needs >= 16 rows: head rows past the group are zeros and never stored.
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_seq = pos < end
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, K + kv_head * stride_kh, V + kv_head * stride_vh,
                                      row, pos, in_seq, in_seq[None, :], max_context, offs_d, d_mask,
                                      stride_rp, stride_ks, stride_kd, stride_vs, stride_vd, qk_scale, UPCAST)

    # An empty split stores o = 0, lse = -inf, which stage 2 weighs by exactly 0.
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    mid = (b * num_heads + heads) * num_splits + split
    tl.store(MidO + mid[:, None] * head_dim + offs_d[None, :], acc / l_safe[:, None],
             mask=h_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + mid, tl.where(has, m_i + tl.log2(l_safe), float("-inf")), mask=h_mask)


@triton.jit
def _decode_merge_kernel(MidO, MidLse, Out, stride_ob, stride_oh, stride_od, num_heads, head_dim,
                         num_splits, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    mid = (b * num_heads + h) * num_splits + offs_s
    lse = tl.load(MidLse + mid, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # seq_len 0 (misuse): zeros, not NaN
    w = tl.exp2(lse - top)
    o = tl.load(MidO + mid[:, None] * head_dim + offs_d[None, :],
                mask=s_mask[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def _extend_kernel(Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, QStart, qk_scale,
                   stride_qt, stride_qh, stride_qd, stride_kh, stride_ks, stride_kd,
                   stride_vh, stride_vs, stride_vd, stride_ot, stride_oh, stride_od,
                   stride_rr, stride_rp, max_context, group_size, head_dim,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   UPCAST: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    m_blk = tl.program_id(1)
    h = tl.program_id(2)
    extend = tl.load(ExtendLens + b)
    if m_blk * BLOCK_M >= extend:  # the grid is sized for the longest sequence
        return
    prefix = tl.load(PrefixLens + b)
    q_start = tl.load(QStart + b).to(tl.int64)
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    m_mask = offs_m < extend
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    kv_head = h // group_size
    row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_rr

    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m  # absolute positions; padded rows (>= extend) are never stored
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = prefix + tl.minimum(extend, (m_blk + 1) * BLOCK_M)  # this block's last row sees < kv_end
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_seq = pos < kv_end
        # Key 0 is visible to every row, so each row's first block has a finite max.
        valid = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, K + kv_head * stride_kh, V + kv_head * stride_vh,
                                      row, pos, in_seq, valid, max_context, offs_d, d_mask,
                                      stride_rp, stride_ks, stride_kd, stride_vs, stride_vd, qk_scale, UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# Under TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors.
_INTERPRETED = not isinstance(_extend_kernel, triton.runtime.JITFunction)


def _check(q, k_buffer, v_buffer, req_to_token, lens: dict, out, batch: int | None) -> None:
    """ValueErrors for misuse a caller can make, where Triton would fail opaquely or read garbage."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_buffer.dim() != 3 or k_buffer.shape != v_buffer.shape:
        raise ValueError("k_buffer and v_buffer must both be [num_kv_heads, pool_size + 1, head_dim], "
                         f"got {tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}")
    num_kv_heads, _, head_dim = k_buffer.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {q.shape[2]}, the KV pool has {head_dim}")
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.dtype not in _DTYPES or k_buffer.dtype != q.dtype or v_buffer.dtype != q.dtype:
        raise ValueError(f"dtype mismatch or unsupported dtype: q {q.dtype}, k_buffer {k_buffer.dtype}, "
                         f"v_buffer {v_buffer.dtype} (need one of float32, bfloat16, float16 for all)")
    if req_to_token.dim() != 2 or req_to_token.dtype not in _INT_DTYPES:
        raise ValueError("req_to_token must be a 2-D int32/int64 table [max_reqs, max_context], "
                         f"got {req_to_token.dtype} of shape {tuple(req_to_token.shape)}")
    for name, t in lens.items():
        if t.dim() != 1 or t.shape[0] != batch or t.dtype not in _INT_DTYPES:
            length = f" of length {batch}" if batch is not None else ""
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor{length}, "
                             f"got {t.dtype} of shape {tuple(t.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
    tensors = [q, k_buffer, v_buffer, req_to_token, *lens.values()] + ([out] if out is not None else [])
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")


def _config(q: torch.Tensor) -> dict:
    """Launch options, after the argument checks. tl.dot needs every dimension >= 16; tiles
    and warps are picked so that sm_80/sm_90 builds do not spill (checked with cuobjdump)."""
    if q.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"tensors on {q.device} need a CUDA device, or TRITON_INTERPRET=1 set "
                         "before triton is imported")
    block_d = max(16, triton.next_power_of_2(q.shape[2]))
    wide = q.element_size() == 2  # fp32 "ieee" dots are register-hungry: half the tile
    # Interpreter only: its tl.dot multiplies bf16 bit patterns (triton#11584), so upcast.
    return dict(BLOCK_D=block_d, UPCAST=_INTERPRETED and q.dtype == torch.bfloat16, num_stages=2,
                BLOCK_N=(64 if wide else 32) // (2 if block_d > 128 else 1),
                num_warps=4 if wide and block_d <= 64 else 8)


def decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
                     out=None, *, num_kv_splits: int | None = None):
    """q ``[B, H, D]`` (one token per sequence, its K/V already in the pool) attends to the
    first ``seq_lens[b]`` (>= 1) tokens of its ``req_to_token`` row. Returns ``[B, H, D]``
    in q's dtype. ``num_kv_splits`` defaults from the batch size and the GPU's SM count."""
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    _check(q, k_buffer, v_buffer, req_to_token,
           {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens}, out, q.shape[0])
    out = torch.empty_like(q) if out is None else out
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    cfg = _config(q)
    group = num_heads // k_buffer.shape[0]
    block_h = 16 if group <= 16 else 32  # query-head rows per program (tl.dot wants >= 16)
    head_progs = k_buffer.shape[0] * triton.cdiv(group, block_h)
    if num_kv_splits is None:  # enough programs to fill the GPU about twice, <= 16 splits
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        num_kv_splits = min(16, triton.cdiv(2 * sms, batch * head_progs))
    mid_o = torch.empty(batch, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, head_progs, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous(),
        mid_o, mid_lse, scale * _LOG2E, *q.stride(), *k_buffer.stride(), *v_buffer.stride(),
        *req_to_token.stride(), req_to_token.shape[1], num_heads, group, head_dim, num_kv_splits,
        BLOCK_H=block_h, **cfg)
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, *out.stride(), num_heads, head_dim, num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=cfg["BLOCK_D"], num_warps=2)
    return out


def extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                     scale, out=None, *, max_extend_len: int | None = None):
    """q ``[T, H, D]`` concatenates each sequence's ``extend_lens[b]`` new tokens; they and
    the ``prefix_lens[b]`` cached ones are in the pool at positions 0..prefix+extend-1 of
    the sequence's ``req_to_token`` row. Causal; returns ``[T, H, D]`` in q's dtype.
    Passing ``max_extend_len`` (the max of extend_lens) skips a device->host sync and, with
    it, the check that extend_lens sums to T."""
    batch = req_pool_indices.shape[0] if req_pool_indices.dim() == 1 else None
    _check(q, k_buffer, v_buffer, req_to_token, {"req_pool_indices": req_pool_indices,
           "prefix_lens": prefix_lens, "extend_lens": extend_lens}, out, batch)
    if max_extend_len is None:
        total, max_extend_len = torch.stack([extend_lens.sum(), extend_lens.max()]).tolist() if batch else (0, 0)
        if total != q.shape[0]:
            raise ValueError(f"extend_lens sum to {total} but q has {q.shape[0]} tokens")
    out = torch.empty_like(q) if out is None else out
    if batch == 0 or max_extend_len <= 0 or q.shape[0] == 0:
        return out
    cfg = _config(q)
    cfg["BLOCK_M"] = cfg["BLOCK_N"]
    q_start = torch.cumsum(extend_lens, 0) - extend_lens  # each sequence's first row in q
    _extend_kernel[(batch, triton.cdiv(max_extend_len, cfg["BLOCK_M"]), q.shape[1])](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices.contiguous(), prefix_lens.contiguous(),
        extend_lens.contiguous(), q_start, scale * _LOG2E, *q.stride(), *k_buffer.stride(),
        *v_buffer.stride(), *out.stride(), *req_to_token.stride(), req_to_token.shape[1],
        q.shape[1] // k_buffer.shape[0], q.shape[2], **cfg)
    return out
