"""What every family's causal LM shares: the decoder stack, which rows get logits, the
final norm and LM head, and loading Hugging Face tensors into TP-sharded parameters.

A family file (llama.py, qwen3_moe.py, ...) subclasses ``CausalLM`` and gives
``make_layer`` (one decoder layer); a family whose checkpoint holds tensors the generic
loader cannot place (experts) overrides ``load_special_weight``.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from distributed.parallel_state import TPGroup
from srt.layers.layernorm import RMSNorm
from srt.layers.rotary_embedding import RotaryEmbedding
from srt.layers.vocab_parallel_embedding import ParallelLMHead
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.model_config import ModelConfig
from srt.models.decoder_stack import DecoderModel, LayerHalves, StageLayers, layer_index

# (fused param, HF name, shard id): HF checkpoints store these separately.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
)


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
    has_experts = False  # a mixture-of-experts family (--ep-size applies)
    is_hybrid = False  # Gated DeltaNet layers with per-request state (hybrid_decoder.py)
    norm_class = RMSNorm  # the final norm's class

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(), dtype: Optional[torch.dtype] = None,
                 stage: Optional[StageLayers] = None, ep_size: int = 1):
        super().__init__()
        if ep_size > 1 and not self.has_experts:
            raise ValueError(f"--ep-size {ep_size}: {config.architecture} has no experts to place "
                             "(expert parallelism is for mixture-of-experts models)")
        self.config, self.tp, self.ep_size = config, tp, ep_size
        stage = stage or StageLayers.whole(config.num_hidden_layers)
        self.model = DecoderModel(config, tp, dtype, stage, self.make_layer, self.norm_class)
        self.stage = self.model.stage
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype) if self.stage.last else None
        if config.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.tie_to(self.model.embed_tokens)

    def make_layer(self, cfg: ModelConfig, tp: TPGroup, index: int, kv_index: int,
                   rotary: RotaryEmbedding, dtype) -> nn.Module:
        """Checkpoint layer ``index`` (see DecoderModel)."""
        raise NotImplementedError(type(self).__name__)

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, halves: Optional[LayerHalves] = None) -> torch.Tensor:
        """float32 logits ``[B, vocab]`` (last new token per sequence) or ``[T, vocab]``;
        with ``fb.logit_rows`` (prompt logprobs: many rows) those rows in the model's dtype,
        and the caller upcasts the few it samples from. ``halves``: see DecoderModel."""
        return self.select_logits(fb, self.model(fb, halves), halves)

    def select_logits(self, fb: ForwardBatch, h: torch.Tensor,
                      halves: Optional[LayerHalves] = None) -> torch.Tensor:
        """The logits of the rows of the final hidden states ``h`` that need them."""
        head = type(self).logits if halves is None else halves.head
        rows = logit_row_index(fb, h.device)
        return head(self, h if rows is None else h[rows], logits_in_float32(fb))

    def logits(self, h: torch.Tensor, float32: bool) -> torch.Tensor:
        """Final norm and LM head over the rows of ``h`` that need logits."""
        return self.lm_head(self.model.norm(h), float32=float32)

    def load_special_weight(self, name: str, tensor: torch.Tensor) -> Optional[str | tuple[str, ...]]:
        """Place a tensor the generic loader cannot (a family's experts) and return the
        parameter(s) it filled; None: not such a tensor."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     only: Optional[set[str]] = None) -> None:
        """Load ``(hf_name, full_tensor)`` pairs; each parameter slices its TP shard.
        ``only``: load just the tensors for these parameters, skip the rest and check
        nothing is missing (another pass over some layers: srt/model_executor/gguf_int4.py)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the same Parameter as embed_tokens
            if self.config.layers_truncated and layer_index(name) >= self.config.num_hidden_layers:
                continue  # a layer cut off by --json-model-override-args
            if not self._holds(name):
                continue  # another pipeline stage's weight
            special = self.load_special_weight(name, tensor) if only is None else None
            if special is not None:
                loaded.update((special,) if isinstance(special, str) else special)
                continue
            shard_id = None
            for fused, hf_part, sid in STACKED_PARAMS:
                if f".{hf_part}." in name:
                    name, shard_id = name.replace(f".{hf_part}.", f".{fused}."), sid
                    break
            if only is not None and name not in only:
                continue
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
        if missing and only is None:
            raise ValueError(f"Checkpoint is missing weights for: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")

    def _holds(self, name: str) -> bool:
        """Whether this stage has the parameter a checkpoint tensor goes to."""
        stage, layer = self.stage, layer_index(name)
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
