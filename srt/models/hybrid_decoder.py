"""What the hybrid Qwen families share (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): a decoder whose
``layer_types`` mix Gated DeltaNet ("linear_attention") and gated full attention.

- Gated attention: ``q_proj`` yields, per head, the query and an output gate (``[H, 2D]``);
  the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. q/k RMSNorm
  per head, partial RoPE (``partial_rotary_factor``).
- Every norm is the zero-centred ``(1 + w)`` RMSNorm, except the GDN's gated norm.
- KV-pool indices count only the full-attention layers, state-pool indices only the GDN
  layers, both from the pipeline stage's first layer.
- TP splits whole heads (attention query heads with their gates, KV heads, GDN key-head
  groups), never pads them: a --tp-size that does not divide them is refused (check_tp_heads).
- The real Qwen3.5 checkpoints are ``*ForConditionalGeneration``: the text decoder under
  ``model.language_model.``; the vision tower (``model.visual.``) and the multi-token
  prediction head (``mtp.``) are not served and are skipped, said in the log.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.attention import Attention
from srt.layers.layernorm import ZeroCenteredRMSNorm
from srt.layers.linear import QKVParallelLinear, RowParallelLinear
from srt.layers.linear_attention.gated_deltanet import GatedDeltaNet
from srt.layers.linear_attention.state_batch import run_linear_attention
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.model_config import ModelConfig
from srt.models.causal_lm import CausalLM
from srt.models.llama import MLP

logger = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"


class GatedSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kv_index: int, rotary, dtype):
        super().__init__()
        bias = bool(getattr(cfg.hf_config, "attention_bias", False))
        d, self.head_dim = cfg.head_dim, cfg.head_dim
        # The query part holds 2 x heads "heads" of D: each head's query, then its gate. A rank's
        # contiguous share is whole (query, gate) pairs since tp divides the heads (check_tp_heads).
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, 2 * cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=bias, tp=tp, params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=bias, tp=tp,
                                        params_dtype=dtype)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, dtype)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5, kv_index)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, fb)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))


class HybridDecoderLayer(nn.Module):
    """Pre-norm token mixer (GDN or gated attention), then the MLP or MoE block."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module, mlp: nn.Module, dtype,
                 state_index: Optional[int]):
        super().__init__()
        if state_index is None:
            self.self_attn = mixer
        else:
            self.linear_attn = mixer
        self.state_index = state_index  # the GDN layer's index in the state pool
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, h, residual: Optional[torch.Tensor], fb: ForwardBatch):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.state_index is None:
            h = self.self_attn(positions, h, fb)
        else:
            h = run_linear_attention(self.linear_attn, h, fb.linear_state, self.state_index)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def layer_types(hf_config) -> list[str]:
    types = list(getattr(hf_config, "layer_types", None) or [])
    if len(types) < hf_config.num_hidden_layers or set(types) - {LINEAR, FULL}:
        raise ValueError(f"hybrid model: layer_types must name {LINEAR!r} or {FULL!r} for each of the "
                         f"{hf_config.num_hidden_layers} layers, got {types}")
    return types[:hf_config.num_hidden_layers]


def check_tp_heads(cfg: ModelConfig, tp_size: int) -> None:
    """Hybrids split whole heads, never padded (CausalLM._pad_heads stays a no-op): the query
    heads, each with its gate beside it in q_proj (a split of the 2H query "heads" at an odd
    point would part a query from its gate); KV heads split or replicated; GDN key-head groups."""
    if tp_size == 1:
        return
    hf, heads, kv = cfg.hf_config, cfg.num_attention_heads, cfg.num_key_value_heads
    bad = []
    if heads % tp_size:
        bad.append(f"num_attention_heads={heads}")
    if kv % tp_size and tp_size % kv:
        bad.append(f"num_key_value_heads={kv} (neither divides the other)")
    if hf.linear_num_key_heads % tp_size:
        bad.append(f"linear_num_key_heads={hf.linear_num_key_heads}")
    if bad:
        raise ValueError(f"{cfg.architecture}: --tp-size {tp_size} does not split the heads of this hybrid "
                         f"model: {', '.join(bad)}; choose a --tp-size that divides them")
    assert cfg.padded_heads(tp_size) == (heads, kv)  # so the loader pads nothing


class HybridForCausalLM(CausalLM):
    norm_class = ZeroCenteredRMSNorm
    is_hybrid = True

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(), dtype=None, stage=None, ep_size: int = 1):
        check_tp_heads(config, tp.size)
        self.types = layer_types(config.hf_config)
        super().__init__(config, tp, dtype, stage, ep_size)

    def make_mlp(self, cfg: ModelConfig, tp: TPGroup, index: int, dtype) -> nn.Module:
        return MLP(cfg, tp, dtype)

    def make_layer(self, cfg, tp, index, kv_index, rotary, dtype) -> HybridDecoderLayer:
        before = self.types[index - kv_index:index]  # this stage's earlier layers
        if self.types[index] == LINEAR:
            mixer, state_index = GatedDeltaNet(cfg.hf_config, tp, dtype), before.count(LINEAR)
        else:
            mixer, state_index = GatedSelfAttention(cfg, tp, before.count(FULL), rotary, dtype), None
        return HybridDecoderLayer(cfg, mixer, self.make_mlp(cfg, tp, index, dtype), dtype, state_index)

    def linear_layers(self) -> list[GatedDeltaNet]:
        """This stage's GDN layers, in state-pool order."""
        return [layer.linear_attn for layer in self.model.layers[self.stage.start:self.stage.end]
                if getattr(layer, "state_index", None) is not None]

    def attention_layer_count(self) -> int:
        return self.types[self.stage.start:self.stage.end].count(FULL)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skipped: dict[str, int] = {}

        def text_weights():
            for name, tensor in weights:
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model."):]
                elif name.startswith(("model.visual.", "mtp.")):
                    part = name.split(".")[1] if name.startswith("model.") else "mtp"
                    skipped[part] = skipped.get(part, 0) + 1
                    continue
                yield name, tensor

        super().load_weights(text_weights())
        if skipped:
            logger.info("%s: not served, skipped from the checkpoint: %s", self.config.architecture,
                        ", ".join(f"{k} ({n} tensors)" for k, n in sorted(skipped.items())))
