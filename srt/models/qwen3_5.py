"""Qwen3.5 / Qwen3.6 dense sizes: three Gated DeltaNet layers to every gated full-attention
layer (``layer_types``), a dense SiLU MLP in each (hybrid_decoder.py). ``Qwen3_5ForCausalLM``
is the text-only layout; ``Qwen3_5ForConditionalGeneration`` the released checkpoints', served
as text (its vision tower is skipped)."""
from srt.models.hybrid_decoder import HybridForCausalLM


class Qwen3_5ForCausalLM(HybridForCausalLM):
    pass


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    pass
