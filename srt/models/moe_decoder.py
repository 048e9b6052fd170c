"""What the mixture-of-experts families share: a decoder layer whose MLP is a sparse MoE
block (srt/layers/moe/) where the config says so and a dense MLP elsewhere, and the
loading of the block's tensors.

A layer is MoE per transformers' rule (``is_moe_layer``: ``mlp_only_layers``,
``decoder_sparse_step``). The block's checkpoint tensors sit under ``mlp.`` (Qwen) or
``block_sparse_moe.`` (Mixtral): per-expert hub names, or transformers' fused 3-D ones.
"""
from __future__ import annotations

from typing import Optional

import torch

from srt.layers.moe import SparseMoeBlock, is_moe_layer, moe_spec_from_config
from srt.models.causal_lm import layer_index
from srt.models.llama import MLP, DecoderLayer, LlamaForCausalLM


class MoeForCausalLM(LlamaForCausalLM):
    has_experts = True
    block_prefix = "mlp."  # where a layer's MoE tensors sit in the checkpoint

    def make_layer(self, cfg, tp, index, kv_index, rotary, dtype) -> DecoderLayer:
        if is_moe_layer(cfg.hf_config, index):
            mlp = SparseMoeBlock(moe_spec_from_config(cfg.hf_config), cfg.hidden_size, tp,
                                 self.ep_size, dtype)
        else:
            mlp = MLP(cfg, tp, dtype)
        return DecoderLayer(cfg, self.make_attention(cfg, tp, kv_index, rotary, dtype), mlp, dtype)

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> Optional[str]:
        i = layer_index(name)
        head = f"model.layers.{i}.{self.block_prefix}"
        if i < 0 or not name.startswith(head):
            return None
        block = self.model.layers[i].mlp
        if not isinstance(block, SparseMoeBlock):
            return None  # a dense layer's MLP (mlp_only_layers): the generic loader's
        return f"model.layers.{i}.mlp." + block.load_weight(name[len(head):], tensor)
