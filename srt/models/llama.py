"""The Llama decoder, and the dense layers every family here builds on.

Llama: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``; rope scaling types.
Mistral, Qwen2 and Qwen3 (their own files) change only switches of ``SelfAttention``;
the MoE families swap the MLP. Parameter names mirror Hugging Face's, with q/k/v and
gate/up fused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.attention import Attention
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.model_config import ModelConfig
from srt.models.causal_lm import CausalLM


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype, intermediate_size: Optional[int] = None):
        super().__init__()
        act = getattr(cfg.hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r} (only silu)")
        bias = bool(getattr(cfg.hf_config, "mlp_bias", False))
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter] * 2, bias=bias, tp=tp, params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, tp=tp, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SelfAttention(nn.Module):
    """``qkv_bias``: bias on q/k/v (Qwen2); ``qk_norm``: RMSNorm over each q and k head
    before RoPE (Qwen3); ``head_dim`` may differ from ``hidden_size / num_heads``."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, kv_index: int, rotary: RotaryEmbedding, dtype,
                 qkv_bias: bool = False, qk_norm: bool = False):
        super().__init__()
        attn_bias = bool(getattr(cfg.hf_config, "attention_bias", False))
        self.head_dim = cfg.head_dim
        heads, kv_heads = cfg.padded_heads(tp.size)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, heads, kv_heads,
                                          bias=qkv_bias or attn_bias, tp=tp, params_dtype=dtype)
        self.o_proj = RowParallelLinear(heads * cfg.head_dim, cfg.hidden_size,
                                        bias=attn_bias, tp=tp, params_dtype=dtype)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary  # one module shared by all layers (buffers are not persistent)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5, kv_index)

    def project_qkv(self, positions: torch.Tensor, x: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, H*D]``, k/v ``[T, KVH*D]``: projected, normed (Qwen3), rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1), v

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.project_qkv(positions, x)
        return self.o_proj(self.attn(q, k, v, fb))


class DecoderLayer(nn.Module):
    """Pre-norm attention then an MLP (dense, or a family's MoE block)."""

    def __init__(self, cfg: ModelConfig, self_attn: SelfAttention, mlp: nn.Module, dtype):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    # The layer in two halves around attention: the compiled prefill (compiled/prefill.py)
    # compiles each half and runs attention, which loops over sequences, eagerly between.
    def pre_attention(self, positions, h, residual: Optional[torch.Tensor]):
        """(q, k, v, residual) for the attention."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        return (*self.self_attn.project_qkv(positions, h), residual)

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor):
        """(h, residual) for the next layer."""
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
        return self.mlp(h), residual

    def forward(self, positions, h, residual: Optional[torch.Tensor], fb: ForwardBatch):
        q, k, v, residual = self.pre_attention(positions, h, residual)
        return self.post_attention(self.self_attn.attn(q, k, v, fb), residual)


class LlamaForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False

    def make_attention(self, cfg: ModelConfig, tp: TPGroup, kv_index: int, rotary, dtype) -> SelfAttention:
        return SelfAttention(cfg, tp, kv_index, rotary, dtype, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

    def make_layer(self, cfg, tp, index, kv_index, rotary, dtype) -> DecoderLayer:
        return DecoderLayer(cfg, self.make_attention(cfg, tp, kv_index, rotary, dtype), MLP(cfg, tp, dtype), dtype)
