"""A sparse MoE block (router, routed experts, optional gated shared expert) and its config.

Families, as transformers 5.24 builds them:
- Qwen3-MoE: softmax top-k, renormalised iff ``norm_topk_prob``; no shared expert.
- Qwen2-MoE: the same router, plus a dense shared expert scaled by sigmoid(``shared_expert_gate``).
- Qwen3.5-MoE: Qwen2-MoE's block, the router always renormalised (no ``norm_topk_prob``).
- Mixtral: always renormalised, routing weights kept in fp32 (``fp32_routing_weights``).

Under TP the router and the shared expert's gate are replicated, so every rank routes the
same tokens; the experts and the shared expert each yield a partial sum, and the block
adds them and all-reduces once. The shared expert's gate is a per-token scalar g(x), the
same on every rank, so ``g * sum_r(partial_r) == sum_r(g * partial_r)``: it scales the
partials before the reduction.

Parameter names mirror Hugging Face's (``gate``, ``shared_expert``, ``shared_expert_gate``)
with the experts stacked (``experts.w13_weight`` / ``experts.w2_weight``) and the shared
expert's gate/up fused; ``load_weight`` takes the checkpoint name's tail after ``mlp.``
(Mixtral's ``block_sparse_moe.``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from distributed.communication import tp_all_reduce
from distributed.parallel_state import TPGroup
from srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from srt.layers.moe.fused_moe import FusedMoE

_QWEN = ("qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate: int           # each routed expert's intermediate size
    renormalize: bool
    shared_intermediate: int = 0  # 0: no shared expert
    fp32_routing_weights: bool = False


def moe_spec_from_config(hf_config) -> MoeSpec:
    """The MoE block of a qwen2_moe / qwen3_moe / qwen3_5_moe / qwen3_next / mixtral config."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = cfg.model_type
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"{kind}: unsupported hidden_act {cfg.hidden_act!r} (only silu)")
    if kind == "mixtral":
        return MoeSpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                       renormalize=True, fp32_routing_weights=True)
    if kind not in _QWEN:
        raise ValueError(f"no MoE block for model_type {kind!r}")
    always_norm = kind.startswith("qwen3_5")  # its router ignores norm_topk_prob
    return MoeSpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   renormalize=always_norm or bool(getattr(cfg, "norm_topk_prob", False)),
                   shared_intermediate=0 if kind == "qwen3_moe" else
                   int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0))


def is_moe_layer(hf_config, layer_idx: int) -> bool:
    """transformers' rule: not in ``mlp_only_layers``, ``num_experts > 0`` and every
    ``decoder_sparse_step``-th layer (Mixtral and Qwen3.5-MoE have neither field: all)."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    only_mlp = getattr(cfg, "mlp_only_layers", None) or ()
    return layer_idx not in only_mlp and experts > 0 and (layer_idx + 1) % step == 0


class ReplicatedWeight(nn.Module):
    """A bias-free ``[out, in]`` projection every rank holds whole (router, shared gate)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param.shape != loaded_weight.shape:
            raise ValueError(f"replicated weight: checkpoint has shape {tuple(loaded_weight.shape)}, "
                             f"parameter expects {tuple(param.shape)}")
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # in the hidden dtype, as transformers computes it


class SharedExpert(nn.Module):
    """A dense SiLU MLP split like the decoder's MLP, whose down projection does *not*
    reduce: its partial sum joins the experts' before the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       tp=tp, params_dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp,
                                           reduce_results=False, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: MoeSpec, hidden_size: int, tp: TPGroup = TPGroup(),
                 ep_size: int = 1, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.tp = tp
        self.gate = ReplicatedWeight(hidden_size, spec.num_experts, dtype)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, hidden_size, spec.intermediate,
                                tp=tp, ep_size=ep_size, params_dtype=dtype,
                                renormalize=spec.renormalize,
                                fp32_routing_weights=spec.fp32_routing_weights)
        if spec.shared_intermediate:
            self.shared_expert = SharedExpert(hidden_size, spec.shared_intermediate, tp, dtype)
            self.shared_expert_gate = ReplicatedWeight(hidden_size, 1, dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output ``[T, H]``, before the all-reduce."""
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.partial_forward(x), self.tp)

    def load_weight(self, name_suffix: str, loaded_weight: torch.Tensor) -> str:
        """Load the checkpoint tensor ``...mlp.<name_suffix>``; returns the parameter name
        (relative to the block) it went to. Expert names: see fused_moe.py."""
        if name_suffix.startswith("experts."):
            return "experts." + self.experts.load_expert_weight(name_suffix[len("experts."):], loaded_weight)
        # checkpoint name -> (parameter name, shard id of its loader)
        names = {"gate.weight": ("gate.weight", None)}
        if self.shared_expert is not None:
            names.update({"shared_expert_gate.weight": ("shared_expert_gate.weight", None),
                          "shared_expert.gate_proj.weight": ("shared_expert.gate_up_proj.weight", 0),
                          "shared_expert.up_proj.weight": ("shared_expert.gate_up_proj.weight", 1),
                          "shared_expert.down_proj.weight": ("shared_expert.down_proj.weight", None)})
        if name_suffix not in names:
            raise KeyError(f"mlp.{name_suffix}: no such parameter in this MoE block")
        target, shard_id = names[name_suffix]
        param = self.get_parameter(target)
        param.weight_loader(param, loaded_weight, shard_id)
        return target
