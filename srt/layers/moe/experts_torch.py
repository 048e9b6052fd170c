"""The routed experts in plain torch: token slots grouped by expert, only hit experts computed.

For x [T, H] and the router's choice (``topk_ids`` / ``topk_weights`` [T, k]):

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

``w13 [E_local, 2*I_local, H]`` is gate rows then up rows; ``w2 [E_local, H, I_local]``. This
rank holds experts ``[expert_offset, expert_offset + E_local)``; a slot routed elsewhere adds
nothing here (its expert-parallel rank adds it, through the block's all-reduce).

Rounding follows transformers 5: each expert's rows are scaled by the routing weight in
the weight's dtype (fp32 for Mixtral, the hidden dtype for Qwen, whose router casts back),
and a token's k terms are summed in fp32 and rounded once, as its ``grouped_mm`` experts do
(what a transformers model, e.g. from ``from_pretrained``, picks on torch >= 2.9). Its eager
loop ``index_add_``s in the hidden dtype instead: equal to ours in fp32, one bf16 rounding
step off in bf16.

Two ways to run the hit experts, bit-equal in every case measured (torch's CPU grouped GEMM
appears to run the same matmul per group). benchmark/bench_moe_cpu.py on 2 AMD EPYC cores
(avx2, avx512f, avx512_bf16, no amx), H=2048, I=768, E=128, k=8, medians of 9 alternating
rounds, two quiet runs, loop / grouped_mm time: fp32 T=1 0.95-1.00, T=8 1.15-1.18, T=64
1.10-1.11; bf16 T=1 0.99-1.07, T=8 1.09-1.10, T=64 1.06-1.15 (T=1: ~12.7 ms fp32, ~8 ms
bf16 for the 8 hit experts). The grouped GEMM skips empty groups (T=1 reads only the hit
experts' weights, as the loop does) and saves the loop's ~10 small ops per hit expert, so it
is the default where it runs (``torch._grouped_mm`` on CPU from torch 2.9, 16-byte aligned
weights); elsewhere the loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _group_by_expert(topk_ids: torch.Tensor, num_local: int, expert_offset: int):
    """(slot order sorted by local expert, slots per local expert [E_local]).

    Slots of other ranks' experts get the sentinel ``num_local`` and sort to the tail, where
    no expert's run reaches them."""
    local = topk_ids.reshape(-1) - expert_offset
    local = torch.where((local >= 0) & (local < num_local), local, num_local)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)[:num_local]
    return order, counts


def _accumulator(x: torch.Tensor) -> torch.Tensor:
    # fp32 sum of a token's k terms, rounded to the hidden dtype once at the end.
    return torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)


def _grouped_mm_runs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    # torch <= 2.8 has no CPU kernel; <= 2.10 needs 16-byte aligned operands (the weights:
    # the activations are fresh tensors). GPUs take fused_moe_triton.py, not this file.
    return (x.device.type == "cpu" and hasattr(torch, "_grouped_mm") and torch.__version__ >= "2.9"
            and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0)


def moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_offset: int = 0) -> torch.Tensor:
    """This rank's share of the experts' output ``[T, H]`` (a partial sum under EP / TP)."""
    run = moe_experts_grouped_mm if _grouped_mm_runs(x, w13, w2) else moe_experts_loop
    return run(x, w13, w2, topk_weights, topk_ids, expert_offset)


def moe_experts_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     expert_offset: int = 0) -> torch.Tensor:
    """One F.linear pair per hit expert."""
    top_k = topk_ids.shape[-1]
    order, counts = _group_by_expert(topk_ids, w13.shape[0], expert_offset)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    out = _accumulator(x)
    start = 0
    for e, n in enumerate(counts.tolist()):  # one host sync: the loop needs the sizes
        if n == 0:
            continue  # never read an expert no token chose
        rows, w = tokens[start:start + n], weights[start:start + n]
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * w[:, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out.to(x.dtype)


def moe_experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           expert_offset: int = 0) -> torch.Tensor:
    """Two ``torch._grouped_mm`` calls over the slots sorted by expert."""
    top_k = topk_ids.shape[-1]
    order, counts = _group_by_expert(topk_ids, w13.shape[0], expert_offset)
    offs = counts.cumsum(0, dtype=torch.int32)
    order = order[:int(offs[-1])]  # the tail is other ranks' slots (the kernel leaves them unset)
    rows = order // top_k
    gate, up = torch._grouped_mm(x[rows], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1)[order][:, None]
    out = _accumulator(x)
    out.index_add_(0, rows, y.to(out.dtype))
    return out.to(x.dtype)
