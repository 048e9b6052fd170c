"""Qwen3.5 / Qwen3-Next Gated DeltaNet layer (the "linear_attention" layers of the hybrid models).

    qkv = silu(causal_conv(in_proj_qkv(x)))   -> q, k [T, Hk, Dk], v [T, Hv, Dv]
    beta = sigmoid(in_proj_b(x)),  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   [T, Hv]
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)                            [T, Hv, Dv]
    y = out_proj(GatedRMSNorm(o, z = in_proj_z(x)))                                   [T, H]

Parameter names and shapes equal the checkpoint's (transformers' Qwen3_5GatedDeltaNet), so its
state_dict loads strictly. TP=1 only for now: sharding needs in_proj_qkv split per key-head group
(q, k and v parts each narrowed), conv1d / A_log / dt_bias / norm split by the same heads.

The layer keeps no state: the caller passes one sequence's conv and recurrent state in and gets the
new ones back, so a state pool (or a speculative-decoding snapshot) owns them and stays untouched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.layers.linear_attention.causal_conv import causal_conv1d
from srt.layers.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from srt.layers.linear_attention.gated_rms_norm import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None, params_dtype: torch.dtype | None = None,
                 chunk_size: int = 64):
        super().__init__()
        tp = tp or TPGroup()  # tp=1
        if tp.size != 1:
            raise NotImplementedError("GatedDeltaNet: tensor parallelism is not supported yet")
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.activation = getattr(config, "hidden_act", "silu")  # transformers applies it in the conv
        self.chunk_size = chunk_size

        mk = {"bias": False, "tp": tp, "params_dtype": dtype}
        self.in_proj_qkv = ColumnParallelLinear(self.hidden_size, self.conv_dim, **mk)
        self.in_proj_z = ColumnParallelLinear(self.hidden_size, self.value_dim, **mk)
        self.in_proj_b = ColumnParallelLinear(self.hidden_size, self.num_v_heads, **mk)
        self.in_proj_a = ColumnParallelLinear(self.hidden_size, self.num_v_heads, **mk)
        # Depthwise conv: kept as nn.Conv1d so the checkpoint's [C, 1, K] weight loads as is;
        # only its weight is used (causal_conv1d does the state handling, not Conv1d.forward).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                bias=False, padding=self.conv_kernel_size - 1, dtype=dtype)
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps, dtype=dtype)
        self.out_proj = RowParallelLinear(self.value_dim, self.hidden_size, **mk)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv_state [conv_dim, K-1] in the weights' dtype, recurrent_state [Hv, Dk, Dv] fp32)."""
        return ((self.conv_dim, self.conv_kernel_size - 1),
                (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor | None = None,
                recurrent_state: torch.Tensor | None = None, recurrent: bool | None = None):
        """x: [T, H], one sequence; states as in ``state_shapes`` or None (= zeros, a new sequence).
        ``recurrent``: token by token (decode rows) rather than chunked; default: only for T == 1.

        Returns ``(y [T, H], new_conv_state, new_recurrent_state)``; the inputs are not modified.
        """
        y, c, s = self.forward_batch(
            x.unsqueeze(0), None if conv_state is None else conv_state.unsqueeze(0),
            None if recurrent_state is None else recurrent_state.unsqueeze(0),
            x.shape[0] == 1 if recurrent is None else recurrent)
        return y.squeeze(0), c.squeeze(0), s.squeeze(0)

    def forward_batch(self, x: torch.Tensor, conv_state: torch.Tensor | None,
                      recurrent_state: torch.Tensor | None, recurrent: bool):
        """B sequences of T new tokens each: x [B, T, H], states [B, ...] or None (zeros).
        Returns ``(y [B, T, H], new_conv_state [B, ...], new_recurrent_state [B, ...])``."""
        b, t = x.shape[0], x.shape[1]
        x = x.reshape(b * t, -1)  # the projections take 2-D rows (packed CPU weights do)
        mixed, new_conv = causal_conv1d(self.in_proj_qkv(x).reshape(b, t, -1), self.conv1d.weight.squeeze(1),
                                        None, conv_state, activation=self.activation)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)

        beta = self.in_proj_b(x).sigmoid().reshape(b, t, -1)
        # In fp32: exp(A_log) can overflow fp16, and g feeds an exponential decay over the sequence.
        g = (-self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)).reshape(b, t, -1)

        if recurrent:
            o, s = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state, use_qk_l2norm=True)
        else:
            o, s = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, self.chunk_size,
                                          use_qk_l2norm=True)
        z = self.in_proj_z(x).reshape(b, t, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.reshape(b, t, self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(o.reshape(b * t, self.value_dim)).reshape(b, t, -1), new_conv, s
