"""The decoder stack every family shares: embedding, one pipeline stage's layers, final
norm. A family says how to build one layer (``MakeLayer``); the stack runs them, eagerly
or through the compiled prefill's halves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from srt.model_executor.forward_batch import ForwardBatch
from srt.model_executor.model_config import ModelConfig

class LayerHalves(Protocol):
    """Compiled replacements of a layer's ``pre_attention`` / ``post_attention`` and of
    ``CausalLM.logits`` (the compiled prefill, model_executor/compiled/prefill.py)."""

    pre: Callable
    post: Callable
    head: Callable


def layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (``model.layers.<i>.``), else -1."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


@dataclass(frozen=True)
class StageLayers:
    """The decoder layers ``[start, end)`` one pipeline stage holds (--pp-size); the first
    stage embeds the tokens, the last holds the final norm and the LM head."""

    start: int
    end: int
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> "StageLayers":
        return cls(0, num_layers)


MakeLayer = Callable[[ModelConfig, TPGroup, int, int, RotaryEmbedding, torch.dtype], nn.Module]


class DecoderModel(nn.Module):
    """Embedding, this stage's layers, final norm. ``make_layer(cfg, tp, index, kv_index,
    rotary, dtype)`` builds checkpoint layer ``index``; ``kv_index`` counts from the
    stage's first layer (its KV-pool index)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype, stage: StageLayers, make_layer: MakeLayer,
                 norm_class: type = RMSNorm):
        super().__init__()
        self.stage = stage
        # The last stage keeps the embedding only for a tied LM head.
        embed = stage.first or (stage.last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype) if embed else None
        self.rotary_emb = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.context_len)
        # Checkpoint names index every layer: another stage's layers are empty placeholders.
        self.layers = nn.ModuleList(
            make_layer(cfg, tp, i, i - stage.start, self.rotary_emb, dtype)
            if stage.start <= i < stage.end else nn.Identity()
            for i in range(cfg.num_hidden_layers))
        self.norm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.last else None

    def forward(self, fb: ForwardBatch, halves: Optional[LayerHalves] = None) -> torch.Tensor:
        """``halves``: compiled replacements of each layer's ``pre_attention`` /
        ``post_attention`` (prefill); None runs each layer eagerly."""
        h, residual = self.run_layers(fb, self.embed_tokens(fb.input_ids), None, halves)
        return h + residual  # pre-norm hidden states; CausalLM normalises the rows it needs

    def run_layers(self, fb: ForwardBatch, h: torch.Tensor, residual: Optional[torch.Tensor],
                   halves: Optional[LayerHalves] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers over ``(h, residual)`` (residual None before the first layer)."""
        for layer in self.layers[self.stage.start:self.stage.end]:
            if halves is None:
                h, residual = layer(fb.positions, h, residual, fb)
            else:
                q, k, v, residual = halves.pre(layer, fb.positions, h, residual)
                h, residual = halves.post(layer, layer.self_attn.attn(q, k, v, fb), residual)
        return h, residual
