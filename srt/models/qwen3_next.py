"""Qwen3-Next (80B-A3B): the hybrid decoder of Qwen3.5 a generation earlier. Experts per
transformers' rule (``mlp_only_layers``, ``decoder_sparse_step``) with a gated shared expert,
routing renormalised when ``norm_topk_prob``.

Its GDN projections are stored fused and interleaved per key-head group: ``in_proj_qkvz``
rows are, for each of the Hk groups, [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] with r = Hv / Hk,
and ``in_proj_ba`` rows [b (r), a (r)] per group. They are split at load into Qwen3.5's
``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, the same products in the
order Qwen3.5 computes them (transformers' ``fix_query_key_value_ordering``), so one layer
serves both families; at TP > 1 the split parts go through the layer's weight loaders, which
keep this rank's key-head groups.
"""
from __future__ import annotations

from typing import Optional

import torch

from srt.layers.moe import SparseMoeBlock, is_moe_layer, moe_spec_from_config
from srt.models.causal_lm import layer_index
from srt.models.hybrid_decoder import HybridForCausalLM
from srt.models.llama import MLP
from srt.models.moe_decoder import MoeForCausalLM


def split_qkvz(w: torch.Tensor, hk: int, dk: int, rdv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_qkvz`` [Hk*(2Dk+2rDv), H] -> (in_proj_qkv [2HkDk + HkrDv, H], in_proj_z [HkrDv, H])."""
    g = w.reshape(hk, 2 * dk + 2 * rdv, -1)
    q, k, v, z = g.split([dk, dk, rdv, rdv], dim=1)
    flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def split_ba(w: torch.Tensor, hk: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``in_proj_ba`` [Hk*2r, H] -> (in_proj_b [Hk*r, H], in_proj_a [Hk*r, H])."""
    b, a = w.reshape(hk, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])


class Qwen3NextForCausalLM(HybridForCausalLM):
    has_experts = True
    block_prefix = "mlp."

    def make_mlp(self, cfg, tp, index, dtype):
        if is_moe_layer(cfg.hf_config, index):
            return SparseMoeBlock(moe_spec_from_config(cfg.hf_config), cfg.hidden_size, tp, self.ep_size, dtype)
        return MLP(cfg, tp, dtype)

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> Optional[tuple[str, ...]]:
        i = layer_index(name)
        head = f"model.layers.{i}.linear_attn."
        if i < 0 or name not in (head + "in_proj_qkvz.weight", head + "in_proj_ba.weight"):
            return MoeForCausalLM.load_special_weight(self, name, tensor)
        gdn, hf = self.model.layers[i].linear_attn, self.config.hf_config
        hk = hf.linear_num_key_heads  # the checkpoint's (all ranks') heads; gdn's are per rank
        r = hf.linear_num_value_heads // hk
        if name.endswith("qkvz.weight"):
            parts = zip(("in_proj_qkv", "in_proj_z"), split_qkvz(tensor, hk, gdn.head_k_dim, r * gdn.head_v_dim))
        else:
            parts = zip(("in_proj_b", "in_proj_a"), split_ba(tensor, hk, r))
        filled = []
        for sub, t in parts:  # full de-interleaved tensors: each loader keeps this rank's heads
            param = getattr(gdn, sub).weight
            param.weight_loader(param, t, None)
            filled.append(f"{head}{sub}.weight")
        return tuple(filled)
