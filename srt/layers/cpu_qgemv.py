"""Quantized GEMVs on CPU (AVX512-BF16): a GGUF's own 4-bit codes and the int8 LM head of
an int4 model, at the few rows of a decode step.

torch's CPU int4 and int8 kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``)
are compute-bound at one row: with the weights streaming from memory, as in a served step,
they read SmolLM2's matrices at 9-17 GB/s where our bf16 GEMV reads ~28 (docs/speed.md
"Quantized GEMVs"). ``cpu_qgemv.cpp`` holds ops that read them at the machine's rate:
``gramsync::int4_linear`` (the codes with a bf16 scale and zero per 32 inputs: torch's
convention, so the same values) and ``gramsync::int8_linear`` (int8 with one fp32 scale per
output). Each takes its weight packed here once at load, in 16-output panels that are one
contiguous stream each; eager and compiled steps call the same op (AOTInductor packages
through its proxy executor).

Used where the CPU has AVX512-BF16 and ``GRAMSYNC_CPU_GEMV`` is on (the switch of our other
GEMV), with the model in bf16 activations (the int4 path's own: the model dtype there is
bf16); elsewhere torch's kernels stay, and they are the reference the tests compare with.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from srt.layers.cpu_int4_linear import Int4Weight, int4_linear
from srt.layers.cpu_int8_linear import Int8Weight, int8_linear
from srt.layers.cpu_kernels import PANEL, load_cpu_kernels

GROUP = 32  # inputs per scale / zero of the int4 op
# Steps of up to this many rows read the int8 LM head (the small-batch graphs' bound);
# larger ones the dense head (oneDNN: compute-bound there).
HEAD_INT8_MAX_ROWS = 16


class PanelInt4(NamedTuple):
    """``gramsync::int4_linear``'s weight (a NamedTuple: torch.compile traces it as values)."""
    wp: torch.Tensor  # uint8 [N / 16, K / 32, 320]
    out_features: int


class PanelInt8(NamedTuple):
    """``gramsync::int8_linear``'s weight."""
    wp: torch.Tensor     # int8 [N / 16, K / 2, 16, 2]
    scale: torch.Tensor  # fp32 [N]
    out_features: int


def qgemv_available() -> bool:
    """The user's GEMV switch is on, the CPU has AVX512-BF16, and the ops are built."""
    from srt.layers.cpu_gemv import cpu_runs, gemv_wanted

    return gemv_wanted() and cpu_runs(torch.bfloat16) and load_cpu_kernels()


def fits(out_features: int, in_features: int) -> bool:
    """Whole panels of outputs and whole groups of inputs."""
    return out_features % PANEL == 0 and in_features % GROUP == 0


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> PanelInt4:
    """codes uint8 0..15 ``[N, K]``, scale and zero ``[N, K / 32]`` (value = (code - 8) *
    scale + zero, rounded to bf16 as torch's kernel takes them) -> the op's panels."""
    n, k = codes.shape
    g = k // GROUP
    c = codes.to(torch.uint8).reshape(n // PANEL, PANEL, g, GROUP // 4, 2, 2)  # panel, n, group, quad, half, j
    c = c.permute(0, 2, 3, 1, 5, 4)  # panel, group, quad, n, j, half: byte 2n+j = half 0 | half 1 << 4
    code_bytes = (c[..., 0] | (c[..., 1] << 4)).reshape(n // PANEL, g, GROUP * PANEL // 2)

    def per_panel(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> bf16 bytes [N/16, G, 32]
        t = t.to(torch.bfloat16).reshape(n // PANEL, PANEL, g).transpose(1, 2).contiguous()
        return t.view(torch.uint8).reshape(n // PANEL, g, 2 * PANEL)

    wp = torch.cat([code_bytes, per_panel(scale), per_panel(zero)], dim=-1).contiguous()
    return PanelInt4(wp, n)


def pack_int8(qdata: torch.Tensor, scale: torch.Tensor) -> PanelInt8:
    """qdata int8 ``[N, K]``, scale ``[N]`` (value = q * scale) -> the op's panels."""
    n, k = qdata.shape
    wp = qdata.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return PanelInt8(wp, scale.float().contiguous(), n)


def panel_int4_linear(x: torch.Tensor, w: PanelInt4, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.gramsync.int4_linear(x.to(torch.bfloat16), w.wp).to(x.dtype)
    return y + bias if bias is not None else y


def panel_int8_linear(x: torch.Tensor, w: PanelInt8, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.gramsync.int8_linear(x.to(torch.bfloat16), w.wp, w.scale).to(x.dtype)
    return y + bias if bias is not None else y



QUANTIZED = (PanelInt4, PanelInt8, Int4Weight, Int8Weight)  # a layer's weight in one of these


class SmallBatchQuantized(NamedTuple):
    """A quantized weight for steps of up to ``max_rows`` rows, the dense weight above: a
    GGUF's own codes (srt/model_executor/gguf_int4.py) and the int8 LM head. Quantized
    kernels beat the dense read only at a few rows (they multiply-add in fp32 or widen every
    weight first, so they turn compute-bound sooner): torch's int4 kernel at batch 1 only
    (SmolLM2's 120 matmuls, 2-vCPU AVX2: 0.73x our GEMV at one row, 0.95x at 4, 2.15x at
    16), ours up to the 16 rows of the small-batch graphs; torch's int8 LM head took 51.6 ms
    at 64 rows where oneDNN's bf16 took 9.7 (docs/speed.md "Quantized GEMVs")."""
    quantized: tuple  # one of QUANTIZED
    dense: torch.Tensor | None  # the oneDNN-packed dense weight of an eager step; None: the layer's own
    max_rows: int


def quantized_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for a weight of one of the ``QUANTIZED`` kinds: ours or torch's op."""
    if isinstance(w, PanelInt4):
        return panel_int4_linear(x, w, bias)
    if isinstance(w, PanelInt8):
        return panel_int8_linear(x, w, bias)
    if isinstance(w, Int4Weight):
        return int4_linear(x, w, bias)
    return int8_linear(x, w, bias)
