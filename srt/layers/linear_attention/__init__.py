"""Linear-attention layers (Gated DeltaNet, for hybrid Qwen3-Next / Qwen3.5): torch reference math.

- ``chunk_gated_delta_rule``: prefill, chunked form; ``recurrent_gated_delta_rule``: decode steps.
  Same semantics, so any split of a sequence across calls, carrying the state, gives one result.
- ``causal_conv1d``: the depthwise causal conv in front of q/k/v, with a carried K-1 input state.
"""
from srt.layers.linear_attention.causal_conv import causal_conv1d
from srt.layers.linear_attention.gated_delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "l2norm", "recurrent_gated_delta_rule"]
