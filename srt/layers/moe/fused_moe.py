"""The routed experts of one MoE block, sharded over the TP group, with their weight loaders.

Parameters (a SiLU-gated MLP per expert, stacked):
    w13_weight [E_local, 2 * I_local, H]   gate rows, then up rows
    w2_weight  [E_local, H, I_local]       down

Sharding over the TP group of ``tp.size`` ranks:
- ``ep_size == 1``: every expert on every rank, its intermediate dim split like a dense MLP
  (rank r holds rows [r*I/tp, (r+1)*I/tp) of gate and of up, and those columns of down);
- ``ep_size == tp.size``: expert parallelism, rank r holds the contiguous experts
  [r*E/ep, (r+1)*E/ep) whole.
Either way ``forward`` returns this rank's *partial* output; the block all-reduces once.

Checkpoint names accepted by ``load_expert_weight`` (the part after ``experts.``):
- per expert, Qwen2-MoE / Qwen3-MoE / Qwen3.5-MoE (the hub's form, and what transformers
  5.24's ``save_pretrained`` writes for all three): ``{i}.gate_proj.weight`` [I, H],
  ``{i}.up_proj.weight`` [I, H], ``{i}.down_proj.weight`` [H, I];
- per expert, Mixtral (hub and ``save_pretrained``, under ``block_sparse_moe.``):
  ``{i}.w1.weight`` (gate), ``{i}.w3.weight`` (up), ``{i}.w2.weight`` (down);
- fused, transformers 5's in-memory layout (its ``state_dict()``, and checkpoints saved from
  it without the conversion): ``gate_up_proj`` [E, 2I, H] (gate then up on dim 1) and
  ``down_proj`` [E, H, I].
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.moe.custom_op import moe_experts
from srt.layers.moe.router import routing_weights, select_experts

# Checkpoint projection name -> shard id of the loaders below.
_SHARD_OF = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint slice has shape {tuple(src.shape)}, "
                         f"parameter expects {tuple(dst.shape)}")
    dst.copy_(src)  # also casts the checkpoint dtype


def moe_sharding(num_experts: int, intermediate_size: int, tp: TPGroup, ep_size: int
                 ) -> tuple[int, int, int]:
    """``(num_local_experts, expert_offset, intermediate_per_rank)``, or ValueError."""
    if ep_size == 1:
        if intermediate_size % tp.size:
            raise ValueError(f"moe_intermediate_size={intermediate_size} is not divisible by "
                             f"tp_size={tp.size}")
        return num_experts, 0, intermediate_size // tp.size
    if ep_size != tp.size:
        raise ValueError(f"ep_size={ep_size} with tp_size={tp.size}: experts are either split "
                         f"over the TP ranks (ep_size=1) or spread whole over them (ep_size=tp_size)")
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
    local = num_experts // ep_size
    return local, tp.rank * local, intermediate_size


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp: TPGroup = TPGroup(), ep_size: int = 1,
                 params_dtype: Optional[torch.dtype] = None, renormalize: bool = True,
                 fp32_routing_weights: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.fp32_routing_weights = fp32_routing_weights  # Mixtral: see router.routing_weights
        self.tp, self.ep_size = tp, ep_size
        self.num_local_experts, self.expert_offset, self.intermediate_per_rank = moe_sharding(
            num_experts, intermediate_size, tp, ep_size)
        self.intermediate_size = intermediate_size
        dtype = params_dtype or torch.get_default_dtype()
        e, i = self.num_local_experts, self.intermediate_per_rank
        # torch.empty: the checkpoint overwrites every value.
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # Set by routing_digest.attach_routing_digest when the batch log is on.
        self.routing_digest = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str,
                      expert_id: int) -> None:
        """Copy this rank's slice of one expert's full hub tensor (``w1`` gate [I, H], ``w3``
        up [I, H], ``w2`` down [H, I]); an expert held by another rank is ignored."""
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"FusedMoE: unknown shard_id {shard_id!r} (w1, w2 or w3)")
        local = expert_id - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return
        hidden, inter = self.w2_weight.shape[1], self.intermediate_size
        full = (hidden, inter) if shard_id == "w2" else (inter, hidden)
        if tuple(loaded_weight.shape) != full:  # a slice of a wrong-sized tensor would pass
            raise ValueError(f"expert {expert_id} {shard_id}: checkpoint has shape "
                             f"{tuple(loaded_weight.shape)}, expects {full}")
        n = self.intermediate_per_rank
        start = self.tp.rank * n if self.ep_size == 1 else 0  # EP keeps the intermediate whole
        if shard_id == "w2":
            _copy(param.data[local], loaded_weight.narrow(1, start, n), f"expert {expert_id} w2")
        else:
            rows = param.data[local].narrow(0, 0 if shard_id == "w1" else n, n)
            _copy(rows, loaded_weight.narrow(0, start, n), f"expert {expert_id} {shard_id}")

    def load_fused_weight(self, name: str, loaded_weight: torch.Tensor) -> None:
        """A transformers-5 fused tensor: ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]."""
        if loaded_weight.dim() != 3 or loaded_weight.shape[0] != self.num_experts:
            raise ValueError(f"experts.{name}: expected [{self.num_experts}, ...], "
                             f"got {tuple(loaded_weight.shape)}")
        for e in range(self.expert_offset, self.expert_offset + self.num_local_experts):
            if name == "gate_up_proj":
                gate, up = loaded_weight[e].split(self.intermediate_size, dim=0)
                self.weight_loader(self.w13_weight, gate, "w1", e)
                self.weight_loader(self.w13_weight, up, "w3", e)
            else:
                self.weight_loader(self.w2_weight, loaded_weight[e], "w2", e)

    def load_expert_weight(self, name_suffix: str, loaded_weight: torch.Tensor) -> str:
        """Load a checkpoint tensor named ``...experts.<name_suffix>`` (forms in the module
        doc); returns the parameter it went to (``w13_weight`` / ``w2_weight``)."""
        parts = name_suffix.split(".")
        if name_suffix in ("gate_up_proj", "down_proj"):
            self.load_fused_weight(name_suffix, loaded_weight)
            return "w13_weight" if name_suffix == "gate_up_proj" else "w2_weight"
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in _SHARD_OF and parts[2] == "weight":
            expert_id, shard_id = int(parts[0]), _SHARD_OF[parts[1]]
            if expert_id >= self.num_experts:
                raise ValueError(f"experts.{name_suffix}: only {self.num_experts} experts")
            param = self.w2_weight if shard_id == "w2" else self.w13_weight
            self.weight_loader(param, loaded_weight, shard_id, expert_id)
            return "w2_weight" if shard_id == "w2" else "w13_weight"
        raise KeyError(f"experts.{name_suffix}: not an expert weight name FusedMoE knows")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's partial output ``[T, H]`` (not reduced: the block reduces once)."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.routing_digest is not None and not torch.compiler.is_compiling():
            self.routing_digest.add(topk_ids)
        weights = routing_weights(topk_weights, x.dtype, self.fp32_routing_weights)
        return moe_experts(x, self.w13_weight, self.w2_weight, weights, topk_ids, self.expert_offset)

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} (offset {self.expert_offset}), "
                f"top_k={self.top_k}, intermediate={self.intermediate_per_rank}/{self.intermediate_size}")
