"""Fused mixture-of-experts (SiLU-gated MLP experts) as two grouped Triton GEMMs.

For x [T, H] routed to k experts per token (``topk_ids`` / ``topk_weights`` [T, k]):

    out[t] = sum_j topk_weights[t, j] * (silu(x[t] @ Wg[e].T) * (x[t] @ Wu[e].T)) @ w2[e].T
    with e = topk_ids[t, j] - expert_offset, Wg = w13[:, :I], Wu = w13[:, I:]

w13 [E_local, 2I, H] stacks the gate and up projections; w2 is [E_local, H, I]. A slot whose
e falls outside [0, E_local) belongs to another expert-parallel rank and adds nothing.

Steps, and why:
1. align (torch, no host sync): the T*k token-slots are sorted by expert and each expert's
   run is padded to a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted list
   belongs to one expert and a GEMM tile reads one weight matrix. Padding rows hold the
   sentinel T*k and are masked out. The list is sized for the worst case, so its length
   depends on T, k and E only (CUDA-graph friendly); unused tail tiles return at once.
2. kernel 1: per tile, gather the tokens' rows of x and multiply them by the expert's gate
   and up rows (two fp32 accumulators over one x tile, so x is read once), storing
   silu(gate) * up: the [T*k, 2I] pre-activation never goes to memory.
3. kernel 2: the down GEMM on those activations, scaled by each slot's routing weight and
   written to the slot's row of a [T*k, H] buffer (zeros for slots of other ranks).
4. torch sums each token's k slot rows in fp32; no atomics, so the result is deterministic.
Under ``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _gate_up_kernel(X, W13, Act, SortedSlots, BlockExpert, num_experts, top_k, num_slots, hidden,
                    inter, stride_xt, stride_xh, stride_we, stride_wn, stride_wh,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)  # e * stride_we can pass 2**31
    if e >= num_experts:  # a tail tile past the last expert's padded run
        return
    slots = tl.load(SortedSlots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    x_rows = X + (slots // top_k)[:, None] * stride_xt
    gate = W13 + e * stride_we + offs_n[None, :] * stride_wn
    up = gate + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        a = tl.load(x_rows + offs_k[None, :] * stride_xh, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        bg = tl.load(gate + offs_k[:, None] * stride_wh, mask=w_mask, other=0.0)
        bu = tl.load(up + offs_k[:, None] * stride_wh, mask=w_mask, other=0.0)
        if UPCAST:  # interpreter only: its tl.dot multiplies bf16 bit patterns (triton#11584)
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        # "ieee" only matters for fp32 weights, which are for exactness (tf32 loses ~3 digits).
        acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(Act + slots[:, None] * inter + offs_n[None, :], act.to(Act.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(Act, W2, RouteW, Out, SortedSlots, BlockExpert, num_experts, num_slots, hidden,
                 inter, stride_we, stride_wh, stride_wi, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    slots = tl.load(SortedSlots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    w_cols = W2 + e * stride_we + offs_n[None, :] * stride_wh
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        a = tl.load(Act + slots[:, None] * inter + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(w_cols + offs_k[:, None] * stride_wi, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    acc *= tl.load(RouteW + slots, mask=valid, other=0.0)[:, None]
    tl.store(Out + slots[:, None] * hidden + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


# Under TRITON_INTERPRET=1 (set before triton is imported) the kernels run on CPU tensors.
_INTERPRETED = not isinstance(_down_kernel, triton.runtime.JITFunction)


def moe_align(topk_ids: torch.Tensor, num_experts: int, expert_offset: int, block_m: int):
    """(sorted_slots, block_expert): slot indices t*k+j grouped by local expert, each group
    padded with the sentinel T*k to a multiple of block_m; block_expert[b] is the expert of
    rows [b*block_m, (b+1)*block_m), or num_experts for unused tail tiles. Only device ops."""
    ids = topk_ids.reshape(-1).to(torch.int64) - expert_offset
    num_slots, dev = ids.numel(), ids.device
    local = (ids >= 0) & (ids < num_experts)
    e = torch.where(local, ids, num_experts)  # bucket E: another rank's slots, dropped below
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, e, torch.ones_like(e))  # not bincount: that syncs on CUDA
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    e_sorted, order = torch.sort(e, stable=True)
    # Rank within its expert = sorted position - the expert's first sorted position.
    rank = torch.arange(num_slots, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    pad_start = torch.cat([pad_end.new_zeros(1), pad_end])  # pad_start[E] = total: unused
    # Each non-empty expert pads < block_m rows, and at most min(E, T*k) are non-empty.
    num_blocks = (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m
    rows = num_blocks * block_m
    dest = torch.where(e_sorted < num_experts, pad_start[e_sorted] + rank, rows)  # row `rows`: a bin
    sorted_slots = torch.full((rows + 1,), num_slots, dtype=torch.int64, device=dev)
    sorted_slots[dest] = order
    tile_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, tile_start, right=True)  # empty experts: skipped
    return sorted_slots[:rows], block_expert


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    """ValueErrors for misuse, where Triton would fail opaquely or read out of bounds."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"need x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    (t, h), (e, i2, h13) = x.shape, w13.shape
    if i2 % 2 or h13 != h or w2.shape != (e, h, i2 // 2):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (need w13 [E, 2I, H], w2 [E, H, I])")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={t}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"dtype mismatch or unsupported dtype: x {x.dtype}, w13 {w13.dtype}, "
                         f"w2 {w2.dtype} (need one of float32, bfloat16, float16 for all)")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_ids must be int32/int64 and topk_weights floating, got "
                         f"{topk_ids.dtype} and {topk_weights.dtype}")
    tensors = (x, w13, w2, topk_weights, topk_ids)
    if any(a.device != x.device for a in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(a.device) for a in tensors})}")


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """The MoE block's output [T, H] in x's dtype (see the module docstring); fp32 accumulation."""
    _check(x, w13, w2, topk_weights, topk_ids)
    (t, hidden), (num_experts, inter) = x.shape, (w13.shape[0], w13.shape[1] // 2)
    num_slots = topk_ids.numel()
    if num_slots == 0 or num_experts == 0 or hidden == 0:
        return torch.zeros_like(x)
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"tensors on {x.device} need a CUDA device, or TRITON_INTERPRET=1 set "
                         "before triton is imported")
    # Few slots per expert (decode): short tiles waste less padding. tl.dot needs dims >= 16.
    small = num_slots <= 32 * num_experts
    cfg = dict(BLOCK_M=16 if small else 64, BLOCK_K=64 if small else 32, num_warps=4,
               UPCAST=_INTERPRETED and x.dtype == torch.bfloat16)
    bn = 32 if small else 64
    sorted_slots, block_expert = moe_align(topk_ids, num_experts, expert_offset, cfg["BLOCK_M"])
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)  # other ranks' rows: unused
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, bn))](
        x, w13, act, sorted_slots, block_expert, num_experts, topk_ids.shape[1], num_slots, hidden,
        inter, *x.stride(), *w13.stride(), BLOCK_N=bn, **cfg)
    out = torch.zeros(num_slots, hidden, dtype=x.dtype, device=x.device)  # zeros: non-local slots
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, bn))](
        act, w2, route_w, out, sorted_slots, block_expert, num_experts, num_slots, hidden, inter,
        *w2.stride(), BLOCK_N=bn, **cfg)
    return out.view(t, -1, hidden).sum(1, dtype=torch.float32).to(x.dtype)
