"""One pre-norm decoder for the Llama family: Llama, Mistral, Qwen2, Qwen3.

The members differ only in switches read from the config:
- Qwen2: bias on q/k/v (not on o_proj);
- Qwen3: RMSNorm over each q and k head before RoPE; ``head_dim`` may differ from
  ``hidden_size / num_heads``;
- Llama: optional ``attention_bias`` (q/k/v/o) and ``mlp_bias``; rope scaling types.
Parameter names mirror Hugging Face's, with q/k/v and gate/up fused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from distributed.parallel_state import TPGroup
from srt.forward_batch import ForwardBatch, ForwardMode
from srt.layers.attention import Attention
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.model_config import ModelConfig

if TYPE_CHECKING:
    from srt.compiled_prefill import LayerHalves

# (fused param, HF name, shard id): HF checkpoints store these separately.
_STACKED = (
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
)


def _layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to (``model.layers.<i>.``), else -1."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype):
        super().__init__()
        act = getattr(cfg.hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Unsupported hidden_act {act!r} (only silu)")
        bias = bool(getattr(cfg.hf_config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias, tp=tp, params_dtype=dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                           tp=tp, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_id: int, rotary: RotaryEmbedding, dtype):
        super().__init__()
        hf = cfg.hf_config
        attn_bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias = attn_bias or cfg.architecture == "Qwen2ForCausalLM"
        self.head_dim = cfg.head_dim
        heads, kv_heads = cfg.padded_heads(tp.size)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, heads, kv_heads,
                                          bias=qkv_bias, tp=tp, params_dtype=dtype)
        self.o_proj = RowParallelLinear(heads * cfg.head_dim, cfg.hidden_size,
                                        bias=attn_bias, tp=tp, params_dtype=dtype)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        if cfg.architecture == "Qwen3ForCausalLM":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary  # one module shared by all layers (buffers are not persistent)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                              cfg.head_dim ** -0.5, layer_id)

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
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_id: int, rotary, dtype):
        super().__init__()
        self.self_attn = SelfAttention(cfg, tp, layer_id, rotary, dtype)
        self.mlp = MLP(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    # The layer in two halves around attention: the compiled prefill (compiled_prefill.py)
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


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype, stage: Optional[StageLayers] = None):
        super().__init__()
        self.stage = stage = stage or StageLayers.whole(cfg.num_hidden_layers)
        # The last stage keeps the embedding only for a tied LM head.
        embed = stage.first or (stage.last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype) if embed else None
        self.rotary_emb = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.context_len)
        # Checkpoint names index every layer: another stage's layers are empty placeholders.
        # A layer's KV-pool index counts from the stage's first layer.
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, i - stage.start, self.rotary_emb, dtype)
            if stage.start <= i < stage.end else nn.Identity()
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.last else None

    def forward(self, fb: ForwardBatch, halves: Optional["LayerHalves"] = None) -> torch.Tensor:
        """``halves``: compiled replacements of ``DecoderLayer.pre_attention`` /
        ``post_attention`` (prefill); None runs each layer eagerly."""
        h, residual = self.run_layers(fb, self.embed_tokens(fb.input_ids), None, halves)
        return h + residual  # pre-norm hidden states; CausalLM normalises the rows it needs

    def run_layers(self, fb: ForwardBatch, h: torch.Tensor, residual: Optional[torch.Tensor],
                   halves: Optional["LayerHalves"] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers over ``(h, residual)`` (residual None before the first layer)."""
        for layer in self.layers[self.stage.start:self.stage.end]:
            if halves is None:
                h, residual = layer(fb.positions, h, residual, fb)
            else:
                q, k, v, residual = halves.pre(layer, fb.positions, h, residual)
                h, residual = halves.post(layer, layer.self_attn.attn(q, k, v, fb), residual)
        return h, residual


def _extend_rows(fb: ForwardBatch, device) -> torch.Tensor:
    """An extend batch's rows that need logits: ``logit_rows`` (prompt logprobs) or the
    last new token of each sequence."""
    if fb.logit_rows is not None:
        return torch.tensor(fb.logit_rows, device=device)
    return torch.tensor(fb.extend_seq_lens_cpu, device=device).cumsum(0) - 1


def logit_row_index(fb: ForwardBatch, device) -> Optional[torch.Tensor]:
    """The rows of a forward's hidden states that get logits, in the order returned (None:
    every row): a MIXED batch's decode rows, then its extend part's; an extend batch's
    ``_extend_rows``."""
    if fb.mode == ForwardMode.MIXED and not fb.return_all_logits:
        ext, d = fb.extend_part, fb.decode_part.batch_size  # every decode row, then extend's
        return torch.cat([torch.arange(d, device=device), d + _extend_rows(ext, device)])
    if fb.mode == ForwardMode.EXTEND and not fb.return_all_logits:
        return _extend_rows(fb, device)
    return None


def logits_in_float32(fb: ForwardBatch) -> bool:
    """Prompt logprobs' many rows stay in the model's dtype (the caller upcasts the few it
    samples from)."""
    part = fb.extend_part if fb.mode == ForwardMode.MIXED else fb
    return fb.return_all_logits or fb.mode == ForwardMode.DECODE or part.logit_rows is None


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(), dtype: Optional[torch.dtype] = None,
                 stage: Optional[StageLayers] = None):
        super().__init__()
        self.config, self.tp = config, tp
        self.model = DecoderModel(config, tp, dtype, stage)
        self.stage = self.model.stage
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype) if self.stage.last else None
        if config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, halves: Optional["LayerHalves"] = None) -> torch.Tensor:
        """float32 logits ``[B, vocab]`` (last new token per sequence) or ``[T, vocab]``;
        with ``fb.logit_rows`` (prompt logprobs: many rows) those rows in the model's dtype,
        and the caller upcasts the few it samples from. ``halves``: see DecoderModel."""
        return self.select_logits(fb, self.model(fb, halves), halves)

    def select_logits(self, fb: ForwardBatch, h: torch.Tensor,
                      halves: Optional["LayerHalves"] = None) -> torch.Tensor:
        """The logits of the rows of the final hidden states ``h`` that need them."""
        head = CausalLM.logits if halves is None else halves.head
        rows = logit_row_index(fb, h.device)
        return head(self, h if rows is None else h[rows], logits_in_float32(fb))

    def logits(self, h: torch.Tensor, float32: bool) -> torch.Tensor:
        """Final norm and LM head over the rows of ``h`` that need logits."""
        return self.lm_head(self.model.norm(h), float32=float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, full_tensor)`` pairs; each parameter slices its TP shard."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the same Parameter as embed_tokens
            if self.config.layers_truncated and _layer_index(name) >= self.config.num_hidden_layers:
                continue  # a layer cut off by --json-model-override-args
            if not self._holds(name):
                continue  # another pipeline stage's weight
            shard_id = None
            for fused, hf_part, sid in _STACKED:
                if f".{hf_part}." in name:
                    name, shard_id = name.replace(f".{hf_part}.", f".{fused}."), sid
                    break
            tensor = self._pad_heads(name, shard_id, tensor)
            if name not in params:
                raise KeyError(f"Checkpoint tensor {name!r} has no matching model parameter")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard_id)
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"Checkpoint is missing weights for: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")

    def _holds(self, name: str) -> bool:
        """Whether this stage has the parameter a checkpoint tensor goes to."""
        stage, layer = self.stage, _layer_index(name)
        if layer >= 0:
            return stage.start <= layer < stage.end
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith(("model.norm.", "lm_head.")):
            return stage.last
        return True

    def _pad_heads(self, name: str, shard_id, tensor: torch.Tensor) -> torch.Tensor:
        """Append zero heads to q/k/v rows and o_proj columns (see ModelConfig.padded_heads)."""
        cfg = self.config
        heads, kv_heads = cfg.padded_heads(self.tp.size)
        if heads == cfg.num_attention_heads:
            return tensor
        d = cfg.head_dim
        if ".qkv_proj." in name:
            if shard_id is None:  # fused [q; k; v]: pad each part
                q, k, v = tensor.split([cfg.num_attention_heads * d, cfg.num_key_value_heads * d,
                                        cfg.num_key_value_heads * d])
                return torch.cat([self._pad_heads(name, s, t) for s, t in (("q", q), ("k", k), ("v", v))])
            rows = (heads if shard_id == "q" else kv_heads) * d
            return F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, rows - tensor.shape[0]])
        if ".o_proj.weight" in name:
            return F.pad(tensor, [0, heads * d - tensor.shape[1]])
        return tensor
