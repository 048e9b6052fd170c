"""What the runtime needs to know about a Hugging Face checkpoint directory."""
from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from srt.models.registry import SUPPORTED_ARCHITECTURES

logger = logging.getLogger(__name__)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _check_dir(path: str) -> None:
    if path.endswith(".gguf"):
        raise FileNotFoundError(
            f"{path} is a GGUF file; convert it with srt.model_executor.model_loader.resolve_model_path() first")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Model directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"No config.json in model directory {path!r}: expected a "
                                "Hugging Face checkpoint (config.json + *.safetensors)")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        extra = (" (found PyTorch *.bin weights; only safetensors are supported)"
                 if glob.glob(os.path.join(path, "*.bin")) else "")
        raise FileNotFoundError(f"No *.safetensors weight files in model directory {path!r}{extra}")


def _apply_overrides(hf, overrides: dict) -> None:
    for key, value in overrides.items():
        if not hasattr(hf, key):  # a typo would otherwise be ignored silently
            raise ValueError(f"--json-model-override-args: {key!r} is not a field of the model's "
                             f"config ({type(hf).__name__})")
        setattr(hf, key, value)
    layers = getattr(hf, "num_hidden_layers", None)
    if "num_hidden_layers" in overrides and not (isinstance(layers, int) and layers >= 1):
        raise ValueError(f"--json-model-override-args: num_hidden_layers must be a positive integer, got {layers!r}")


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    architecture: str
    # The transformers config (not hashed/compared: it is a mutable object).
    hf_config: Any = field(repr=False, compare=False, hash=False)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    context_len: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    dtype: Optional[str] = None  # the checkpoint's dtype, informational
    # Fewer layers than the checkpoint's (--json-model-override-args): the loader skips the rest.
    layers_truncated: bool = False

    @classmethod
    def from_path(cls, path: str, context_length: Optional[int] = None,
                  overrides: Optional[dict] = None) -> "ModelConfig":
        """Read ``path/config.json`` (and ``generation_config.json``); validate the architecture.
        ``overrides`` (``--json-model-override-args``) replace fields of the config."""
        from transformers import AutoConfig

        path = os.path.abspath(path)
        _check_dir(path)
        top = AutoConfig.from_pretrained(path)
        archs = list(getattr(top, "architectures", None) or [])
        # A multimodal checkpoint (Qwen3.5's *ForConditionalGeneration) nests the decoder's
        # config in ``text_config``: that is the one served.
        hf = top.get_text_config() if hasattr(top, "get_text_config") else top
        checkpoint_layers = hf.num_hidden_layers
        _apply_overrides(hf, overrides or {})
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"Unsupported model architecture {archs or [getattr(hf, 'model_type', None)]} "
                f"in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = _as_ids(getattr(hf, "eos_token_id", None) or getattr(top, "eos_token_id", None))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos += _as_ids(json.load(f).get("eos_token_id"))
        return cls(
            model_path=path,
            architecture=arch,
            hf_config=hf,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            # Qwen3.5-MoE has no dense MLP: its only MLP width is the experts'.
            intermediate_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            context_len=_context_len(hf, context_length),
            eos_token_ids=tuple(dict.fromkeys(eos)),  # de-duplicated, order kept
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
            dtype=str(getattr(hf, "dtype", None) or "").removeprefix("torch.") or None,
            layers_truncated=hf.num_hidden_layers < checkpoint_layers,
        )

    def padded_heads(self, tp_size: int) -> tuple[int, int]:
        """(query heads, KV heads) the model is built with at ``tp_size``.

        When ``tp_size`` does not divide the heads (SmolLM2-135M has 9 query / 3 KV heads,
        so TP=2 would not split), whole KV groups of zero heads are appended: a zero query
        head attends to zero values and its zero ``o_proj`` columns add nothing, so the
        output is exactly the unpadded model's. The query/KV grouping is unchanged.
        """
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        group = heads // kv
        while not (kv * group % tp_size == 0 and (kv % tp_size == 0 or tp_size % kv == 0)):
            kv += 1
        return kv * group, kv

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads stored per rank; heads are replicated when tp_size exceeds them."""
        return max(1, self.padded_heads(tp_size)[1] // tp_size)


def _context_len(hf: Any, requested: Optional[int]) -> int:
    derived = int(getattr(hf, "max_position_embeddings", 0) or 2048)
    # Sliding-window attention is not implemented: cap the context at the window, where
    # full attention and sliding-window attention agree.
    window = getattr(hf, "sliding_window", None)
    if window and getattr(hf, "use_sliding_window", True) and window < derived:
        logger.warning("Model uses sliding-window attention (window %d); capping the context "
                       "length at the window", window)
        derived = int(window)
    if requested is None:
        return derived
    if requested > derived:
        logger.warning("context_length=%d exceeds the model's %d; positions beyond it may "
                       "degrade quality", requested, derived)
    return int(requested)
