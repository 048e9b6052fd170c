"""int4 weights on CPU (``--torchao-config int4wo-<group>`` on a CPU device).

torch ships a CPU int4 GEMM, ``aten._weight_int4pack_mm_for_cpu`` (AVX2 / AVX-512; the
kernel torchao's ``Int4OpaqueTensor`` calls), over weights packed by
``aten._convert_weight_to_int4pack_for_cpu``: 4-bit values, one bf16 scale and zero per
``group`` inputs of each output row. torchao chooses those (its tinygemm affine scheme,
``Int4OpaqueTensor.from_hp``); we keep only the packed weight, its scales and the group
size on the layer and call the kernel ourselves, because the kernel is fast only with bf16
activations (fp32 ones take a slow path: 281 vs 13 ms for SmolLM2's linear layers at one
row, 2-vCPU AVX2), and the model may serve in fp32: activations go in as bf16 and the
output comes back in the model's dtype.

The server quantizes the decoder's linear layers only (``head=False``): the embedded
model's GGUF stores the tied embedding as Q8_0, and an int4 LM head cost 6% perplexity.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)


class Int4Weight(NamedTuple):
    """What the kernel needs (a NamedTuple: torch.compile traces it as plain values)."""
    qdata: torch.Tensor           # packed 4-bit weight
    scale_and_zero: torch.Tensor  # [K / group, N, 2] bf16
    group: int
    out_features: int


def int4_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def quantize_int4(weight: torch.Tensor, group: int) -> Int4Weight:
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    t = Int4OpaqueTensor.from_hp(weight.detach().to(torch.bfloat16), [1, group])
    return Int4Weight(t.qdata, t.scale_and_zero, group, weight.shape[0])


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, w.qdata, w.group, w.scale_and_zero)
    y = y[:, :w.out_features].to(x.dtype).reshape(*x.shape[:-1], w.out_features)
    return y + bias if bias is not None else y


def int4_from_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> Int4Weight:
    """Pack given codes (uint8 0..15, ``[N, K]``) with their affine scale and zero (bf16,
    ``[N, K / group]``; value = (code - 8) * scale + zero): a GGUF's own Q4 codes
    (srt/model_executor/gguf_int4.py), no new rounding."""
    qdata = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    scale_and_zero = torch.stack([scale, zero], dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()
    return Int4Weight(qdata, scale_and_zero, group, codes.shape[0])

