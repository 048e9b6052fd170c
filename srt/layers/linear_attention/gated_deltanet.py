"""Qwen3.5 / Qwen3-Next Gated DeltaNet layer (the "linear_attention" layers of the hybrid models).

    qkv = silu(causal_conv(in_proj_qkv(x)))   -> q, k [T, Hk, Dk], v [T, Hv, Dv]
    beta = sigmoid(in_proj_b(x)),  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   [T, Hv]
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)                            [T, Hv, Dv]
    y = out_proj(GatedRMSNorm(o, z = in_proj_z(x)))                                   [T, H]

Parameter names and shapes equal the checkpoint's (transformers' Qwen3_5GatedDeltaNet), so its
state_dict loads strictly at TP=1. At TP > 1 each rank holds Hk/tp key heads and the Hv/tp value
heads grouped with them (v head j reads k head j // (Hv/Hk), so contiguous ranges line up):
in_proj_qkv and conv1d narrow their q, k and v rows each (a contiguous split of the fused rows
would mix heads), in_proj_z/b/a and A_log/dt_bias narrow by v heads, the gated norm (over one
head's Dv, shared) is replicated and out_proj sums the ranks' value heads.

The layer keeps no state: the caller passes one sequence's conv and recurrent state in and gets the
new ones back, so a state pool (or a speculative-decoding snapshot) owns them and stays untouched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from srt.layers.linear_attention.causal_conv import causal_conv1d
from srt.layers.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from srt.layers.linear_attention.fla_kernels import fla_gated_delta_rule, use_fla
from srt.layers.linear_attention.gated_rms_norm import GatedRMSNorm


def _rank_rows(tp: TPGroup, sizes: tuple[int, ...]):
    """A weight loader: the full checkpoint tensor's rows are parts of ``sizes``; this rank
    keeps its contiguous share of each part, in order (shard_id is ignored: always full)."""
    def load(param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if full.shape[0] != sum(sizes):
            raise ValueError(f"GatedDeltaNet: checkpoint tensor has {full.shape[0]} rows, expected {sum(sizes)}")
        n = [s // tp.size for s in sizes]
        shard = torch.cat([t.narrow(0, tp.rank * k, k) for t, k in zip(full.split(sizes), n)])
        if shard.shape != param.shape:
            raise ValueError(f"GatedDeltaNet: checkpoint shard has shape {tuple(shard.shape)}, "
                             f"parameter expects {tuple(param.shape)}")
        param.data.copy_(shard)
    return load


class GatedDeltaNet(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None, params_dtype: torch.dtype | None = None,
                 chunk_size: int = 64):
        super().__init__()
        tp = tp or TPGroup()  # tp=1
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if hv % hk:
            raise ValueError(f"GatedDeltaNet: linear_num_value_heads={hv} is not a multiple of "
                             f"linear_num_key_heads={hk}")
        if hk % tp.size:  # ranks split by whole key-head groups (no padding for GDN heads)
            raise ValueError(f"GatedDeltaNet: --tp-size {tp.size} does not divide linear_num_key_heads={hk}")
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size = config.hidden_size
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        # This rank's heads: the state pool and every reshape below are per rank.
        self.num_k_heads, self.num_v_heads = hk // tp.size, hv // tp.size
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.activation = getattr(config, "hidden_act", "silu")  # transformers applies it in the conv
        self.chunk_size = chunk_size

        qkv = (hk * self.head_k_dim, hk * self.head_k_dim, hv * self.head_v_dim)  # full q, k, v rows
        mk = {"bias": False, "tp": tp, "params_dtype": dtype}
        self.in_proj_qkv = MergedColumnParallelLinear(self.hidden_size, qkv, **mk)
        self.in_proj_z = ColumnParallelLinear(self.hidden_size, hv * self.head_v_dim, **mk)
        self.in_proj_b = ColumnParallelLinear(self.hidden_size, hv, **mk)
        self.in_proj_a = ColumnParallelLinear(self.hidden_size, hv, **mk)
        # Depthwise conv: kept as nn.Conv1d so the checkpoint's [C, 1, K] weight loads as is;
        # only its weight is used (causal_conv1d does the state handling, not Conv1d.forward).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                bias=False, padding=self.conv_kernel_size - 1, dtype=dtype)
        self.conv1d.weight.requires_grad_(False)
        self.conv1d.weight.weight_loader = _rank_rows(tp, qkv)  # channels are the qkv rows
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.dt_bias.weight_loader = self.A_log.weight_loader = _rank_rows(tp, (hv,))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps, dtype=dtype)
        self.out_proj = RowParallelLinear(hv * self.head_v_dim, self.hidden_size, **mk)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's (conv_state [conv_dim, K-1] in the weights' dtype, recurrent_state [Hv, Dk, Dv] fp32)."""
        return ((self.conv_dim, self.conv_kernel_size - 1),
                (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None = None,
                recurrent_state: torch.Tensor | None = None, recurrent: bool | None = None,
                all_states: bool = False):
        """x: [T, H], one sequence; states as in ``state_shapes`` or None (= zeros, a new sequence).
        ``recurrent``: token by token (decode rows) rather than chunked; default: only for T == 1.

        Returns ``(y [T, H], new_conv_state, new_recurrent_state)``; the inputs are not modified.
        ``all_states`` (token by token only): also both states after each token, ``[T, ...]``.
        """
        out = self.forward_batch(
            x.unsqueeze(0), None if conv_state is None else conv_state.unsqueeze(0),
            None if recurrent_state is None else recurrent_state.unsqueeze(0),
            x.shape[0] == 1 if recurrent is None else recurrent, all_states)
        return tuple(t.squeeze(0) for t in out)

    def forward_batch(self, x: torch.Tensor, conv_state: torch.Tensor | None,
                      recurrent_state: torch.Tensor | None, recurrent: bool, all_states: bool = False):
        """B sequences of T new tokens each: x [B, T, H], states [B, ...] or None (zeros).
        Returns ``(y [B, T, H], new_conv_state [B, ...], new_recurrent_state [B, ...])``."""
        b, t = x.shape[0], x.shape[1]
        x = x.reshape(b * t, -1)  # the projections take 2-D rows (packed CPU weights do)
        conv_out = causal_conv1d(self.in_proj_qkv(x).reshape(b, t, -1), self.conv1d.weight.squeeze(1),
                                 None, conv_state, activation=self.activation, all_states=all_states)
        mixed, new_conv = conv_out[:2]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)

        beta = self.in_proj_b(x).sigmoid().reshape(b, t, -1)
        # In fp32: exp(A_log) can overflow fp16, and g feeds an exponential decay over the sequence.
        g = (-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)).reshape(b, t, -1)

        if use_fla(x) and not all_states:  # CUDA: FLA's kernels (fla_kernels.py)
            o, s = fla_gated_delta_rule(q, k, v, g, beta, recurrent_state, recurrent)
        elif recurrent:
            rec_out = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state, use_qk_l2norm=True,
                                                 all_states=all_states)
            o, s = rec_out[:2]
        elif all_states:
            raise ValueError("all_states needs the token-by-token form (recurrent=True)")
        else:
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, self.chunk_size,
                                          use_qk_l2norm=True)
        z = self.in_proj_z(x).reshape(b, t, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.reshape(b, t, self.num_v_heads, self.head_v_dim), z)
        y = self.out_proj(o.reshape(b * t, self.value_dim)).reshape(b, t, -1)
        if all_states:
            return y, new_conv, s, conv_out[2], rec_out[2]
        return y, new_conv, s
