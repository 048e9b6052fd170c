"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k RMSNorm), experts routed
by softmax top-k, renormalised when ``norm_topk_prob``; no shared expert."""
from srt.models.moe_decoder import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True
