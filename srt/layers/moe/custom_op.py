"""The routed experts as one opaque op, ``gramsync::moe_experts``, for torch.compile.

The experts group tokens by a data-dependent routing (sizes read on the host, a Python loop
over the hit experts), which dynamo cannot trace without a graph break. As a
``torch.library`` custom op the whole computation is one node whose output shape is the
input's (the fake below), so ``torch.compile(fullgraph=True)`` of a model holding MoE
blocks traces; the op runs the eager torch path when the graph runs.

On CUDA the experts run the Triton fused-MoE kernel (fused_moe_triton.py; tested against
the torch path under TRITON_INTERPRET=1 and by ``make gpu-check``), everywhere else the
torch path (experts_torch.py).
"""
from __future__ import annotations

import torch

from srt.layers.moe.experts_torch import moe_experts_torch


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, expert_offset: int) -> torch.Tensor:
    if x.is_cuda:
        from srt.layers.moe.fused_moe_triton import fused_moe_triton  # needs triton: CUDA only

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, expert_offset)
    return moe_experts_torch(x, w13, w2, topk_weights, topk_ids, expert_offset)


@torch.library.custom_op("gramsync::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_offset: int) -> torch.Tensor:
    return _experts(x, w13, w2, topk_weights, topk_ids, expert_offset)


@_moe_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, expert_offset):
    return torch.empty_like(x)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_offset: int = 0) -> torch.Tensor:
    """The experts' output ``[T, H]``: through the op while torch.compile traces, else the
    plain function (the op's dispatch would only add overhead to an eager step)."""
    if torch.compiler.is_compiling():
        return torch.ops.gramsync.moe_experts(x, w13, w2, topk_weights, topk_ids, expert_offset)
    return _experts(x, w13, w2, topk_weights, topk_ids, expert_offset)
