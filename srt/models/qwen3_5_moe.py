"""Qwen3.5 / Qwen3.6 MoE sizes (35B-A3B, 122B-A10B, 397B-A17B): the hybrid decoder of
qwen3_5.py with, in every layer, routed experts (softmax top-k, always renormalised) plus a
shared expert gated by sigmoid(``shared_expert_gate``) - srt/layers/moe/."""
from srt.layers.moe import SparseMoeBlock, moe_spec_from_config
from srt.models.hybrid_decoder import HybridForCausalLM
from srt.models.moe_decoder import MoeForCausalLM


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    has_experts = True
    block_prefix = "mlp."
    load_special_weight = MoeForCausalLM.load_special_weight

    def make_mlp(self, cfg, tp, index, dtype):
        return SparseMoeBlock(moe_spec_from_config(cfg.hf_config), cfg.hidden_size, tp, self.ep_size, dtype)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    pass
