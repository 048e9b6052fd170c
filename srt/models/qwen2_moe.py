"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias), routed experts
plus a dense shared expert scaled by sigmoid(``shared_expert_gate``) - the expert block
Qwen3.5-MoE keeps."""
from srt.models.moe_decoder import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    qkv_bias = True
