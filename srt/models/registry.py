"""Which model class serves a checkpoint, keyed by its config's ``architectures`` name.

Each family is one module in srt/models/ whose class bears the architecture's name; it is
imported only when a checkpoint asks for it.
"""
from __future__ import annotations

import importlib

# architecture name -> module in srt/models/ (the order is the one error messages list)
_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}

SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def model_class(architecture: str) -> type:
    """The ``CausalLM`` subclass for ``architecture``; ValueError for one not served."""
    module = _FAMILIES.get(architecture)
    if module is None:
        raise ValueError(f"Unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return getattr(importlib.import_module(f"srt.models.{module}"), architecture)
