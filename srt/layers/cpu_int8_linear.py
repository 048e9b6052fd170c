"""int8 weights on CPU for the LM head of an int4 model (``--torchao-config int4wo-<group>``).

With the decoder's linear layers in int4, the bf16 LM head is the largest single read of a
decode step (SmolLM2: 49,152 x 576, 57 MB of 66 + 57 MB). An int4 head cost 6% perplexity;
int8 is what the embedded model's own GGUF stores for that matrix (Q8_0). torch ships the
CPU kernel, ``aten._weight_int8pack_mm`` (int8 weight, one scale per output row; the op
Inductor's weight-only-int8 pattern emits): 0.53 against 0.91 ms for SmolLM2's head at one
row, bf16, 2-vCPU AMD EPYC. Like the int4 kernel it is fast only with bf16 activations
(18.7 ms with fp32 ones), so activations go in as bf16 and the output comes back in the
model's dtype. The scales are symmetric per row (max |w| / 127), computed in fp32.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class Int8Weight(NamedTuple):
    """What the kernel needs (a NamedTuple: torch.compile traces it as plain values)."""
    qdata: torch.Tensor   # [N, K] int8
    scales: torch.Tensor  # [N] bf16
    out_features: int


def int8_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    qdata = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(qdata, scales.to(torch.bfloat16), weight.shape[0])


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(rows, w.qdata, w.scales)
    y = y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
    return y + bias if bias is not None else y
