"""Tensor-parallel linear layers (Megatron-style) with per-parameter weight loaders.

Column-parallel layers split the *output* features over the TP ranks (no communication);
row-parallel layers split the *input* features and sum the partial outputs with an
all-reduce. A column layer followed by a row layer (qkv -> o, gate_up -> down) therefore
costs one all-reduce per block.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)`` that takes
the *full* Hugging Face tensor and copies this rank's slice, so checkpoints are sharded at
load time and the model code never needs to know the layout.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from distributed.communication import tp_all_gather_last_dim, tp_all_reduce
from distributed.parallel_state import TPGroup
from srt.layers.cpu_packed_linear import linear


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp_size={d}")
    return n // d


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shard has shape {tuple(src.shape)}, "
                         f"parameter expects {tuple(dst.shape)}")
    dst.copy_(src)  # copy_ also casts the checkpoint dtype to the parameter dtype


class _TPLinear(nn.Module):
    """Holds ``weight [out_local, in_local]`` and an optional ``bias [out_local]``."""

    def __init__(self, in_local: int, out_local: int, bias: bool, tp: TPGroup,
                 params_dtype: Optional[torch.dtype]):
        super().__init__()
        self.tp = tp
        dtype = params_dtype or torch.get_default_dtype()
        # torch.empty: every value is overwritten by the checkpoint, so skip init cost.
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: Optional[torch.Tensor] = None  # set by pack_linear_weights (CPU, eager)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id=None) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class ColumnParallelLinear(_TPLinear):
    """``y = x W^T + b`` with W split along the output dim; each rank yields its slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), gather_output: bool = False,
                 params_dtype: Optional[torch.dtype] = None):
        self.output_size_per_rank = _divide(output_size, tp.size, "output_size")
        super().__init__(input_size, self.output_size_per_rank, bias, tp, params_dtype)
        self.gather_output = gather_output

    def weight_loader(self, param, loaded_weight, shard_id=None):
        n = self.output_size_per_rank
        _copy_checked(param.data, loaded_weight.narrow(0, self.tp.rank * n, n), "column")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.packed_weight, self.bias)
        return tp_all_gather_last_dim(y, self.tp) if self.gather_output else y


class RowParallelLinear(_TPLinear):
    """W split along the input dim; partial products are summed over the TP group.

    The bias is added by rank 0 only, before the reduction, so the sum holds it once
    (and ``reduce_results=False`` leaves per-rank partials that still sum correctly).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), reduce_results: bool = True,
                 params_dtype: Optional[torch.dtype] = None):
        self.input_size_per_rank = _divide(input_size, tp.size, "input_size")
        super().__init__(self.input_size_per_rank, output_size, bias, tp, params_dtype)
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1:  # bias is replicated
            _copy_checked(param.data, loaded_weight, "row bias")
            return
        n = self.input_size_per_rank
        _copy_checked(param.data, loaded_weight.narrow(1, self.tp.rank * n, n), "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        y = linear(x, self.weight, self.packed_weight, bias)
        return tp_all_reduce(y, self.tp) if self.reduce_results else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers fused into one matmul (gate_proj + up_proj).

    Rank r's weight is ``[shard_r(out_0); shard_r(out_1); ...]``, so the local output
    splits back into the logical outputs with ``torch.split(y, sizes_per_rank)``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 tp: TPGroup = TPGroup(), params_dtype: Optional[torch.dtype] = None):
        self.output_sizes = tuple(output_sizes)
        self.sizes_per_rank = tuple(_divide(s, tp.size, "output_size") for s in output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, params_dtype=params_dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # an already-fused checkpoint tensor: load each part
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        n = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        _copy_checked(param.data.narrow(0, offset, n),
                      loaded_weight.narrow(0, self.tp.rank * n, n), f"merged[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection; each rank holds its query heads and their KV heads.

    When ``tp.size > total_num_kv_heads`` every KV head is replicated on
    ``tp.size // total_num_kv_heads`` consecutive ranks (rank r holds KV head
    ``r // replicas``), which keeps each rank's query heads next to their KV head.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, tp: TPGroup = TPGroup(),
                 params_dtype: Optional[torch.dtype] = None):
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp.size, "num_attention_heads")
        if tp.size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp.size, total_num_kv_heads, "tp_size over num_kv_heads")
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        local_out = self.q_size + 2 * self.kv_size
        # Built via the column base with tp.size "virtually" 1 on the output dim: the
        # local output size is computed here, not by dividing the total.
        _TPLinear.__init__(self, hidden_size, local_out, bias, tp, params_dtype)
        self.output_size_per_rank = local_out
        self.gather_output = False

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # fused checkpoint tensor [q; k; v] of the full model
            q, k, v = loaded_weight.split([self.total_num_heads * self.head_size,
                                           self.total_num_kv_heads * self.head_size,
                                           self.total_num_kv_heads * self.head_size], dim=0)
            for sid, part in (("q", q), ("k", k), ("v", v)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            offset, n, src = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            n, src = self.kv_size, (self.tp.rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"QKVParallelLinear: unknown shard_id {shard_id!r}")
        _copy_checked(param.data.narrow(0, offset, n), loaded_weight.narrow(0, src, n),
                      f"qkv[{shard_id}]")
