"""Top-k expert selection from the router's logits, as transformers 5's MoE routers do it.

Qwen2-MoE / Qwen3-MoE (``norm_topk_prob``), Qwen3.5-MoE and Mixtral (always renormalised)
share one recipe: softmax over all experts in fp32, top-k of the probabilities, then
optionally divide by their sum. They differ afterwards: the Qwen routers cast the weights
back to the logits' (hidden) dtype before the experts scale their outputs, Mixtral's keep
fp32. ``routing_weights`` applies that last step, so the expert sum rounds like theirs.
"""
from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32 [T, k], topk_ids int64 [T, k])`` for logits ``[T, E]``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def routing_weights(topk_weights: torch.Tensor, hidden_dtype: torch.dtype,
                    fp32_weights: bool) -> torch.Tensor:
    """The weights in the dtype the family's experts multiply by (see the module doc)."""
    return topk_weights if fp32_weights else topk_weights.to(hidden_dtype)
