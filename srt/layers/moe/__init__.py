"""Mixture-of-experts layers (torch path): router, routed experts, the sparse block.

The Triton kernel (``fused_moe_triton``) is not imported here: it needs triton, and the
torch path must import on any machine.
"""
from srt.layers.moe.experts_torch import moe_experts_torch
from srt.layers.moe.fused_moe import FusedMoE, moe_sharding
from srt.layers.moe.router import select_experts
from srt.layers.moe.sparse_block import MoeSpec, SparseMoeBlock, is_moe_layer, moe_spec_from_config

__all__ = ["FusedMoE", "MoeSpec", "SparseMoeBlock", "is_moe_layer", "moe_experts_torch",
           "moe_sharding", "moe_spec_from_config", "select_experts"]
