"""oneDNN-packed weights for the eager linear layers on CPU.

``F.linear`` on a CPU build of torch calls MKL's sgemm, which re-packs the weight on every
call and, on AMD CPUs, takes a generic path: at the few rows of a decode step it reads the
weights at a third to a half of memory speed (SmolLM2's LM head, batch 4: 31 ms against
9 ms packed). oneDNN's linear with a weight packed once at load (the op Inductor's
``freezing`` emits for the compiled step) was faster alone at every row count measured,
1 to 2,048; a whole prefill step gains nothing measurable (docs/speed.md). The compiled step packs its own copy, so this serves only steps
that run eagerly: compile off (``--disable-torch-compile``, TP > 1 on CPU, the test
suite) and ``GRAMSYNC_CPU_PACKED_LINEAR`` not 0. Results differ from MKL's by rounding
only (accumulation order; ~4e-6 relative in fp32).
"""
from __future__ import annotations

import logging

import torch

from srt.layers.cpu_gemv import small_linear, use_gemv
from torch.fx.experimental.symbolic_shapes import statically_known_true

from srt.layers.cpu_qgemv import QUANTIZED, SmallBatchQuantized, quantized_linear

logger = logging.getLogger(__name__)


def packing_supported(dtype: torch.dtype) -> bool:
    """fp32 always; bf16 only where the CPU computes it natively (AVX512-BF16 / AMX)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque tensor; no batch-size hint, so
    one packing serves every row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@torch.library.custom_op("gramsync::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int) -> torch.Tensor:
    return packed_linear(x, packed, bias)


@_onednn_linear_op.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The layers' matmul: the packed weight when there is one, except while torch.compile
    traces (Inductor packs the weight its own way, from the dense one); in a trace of a
    graph of up to 16 rows on CPU, the hand-written GEMV (cpu_gemv.py)."""
    if isinstance(packed, SmallBatchQuantized):  # a GGUF's codes up to a few rows (known when traced)
        rows = x.numel() // x.shape[-1]
        if statically_known_true(rows <= packed.max_rows):
            return quantized_linear(x, packed.quantized, bias)
        if (packed.dense is not None and torch.compiler.is_compiling()
                and not statically_known_true(rows > packed.max_rows)):
            # A graph of any row count (the prefill's layer halves): the packed dense rows
            # through an opaque op, as in an eager step. Inductor cannot pack a weight that
            # is a graph input, and aten::mm re-lays the plain one out on every call (1.4-1.7x
            # the packed time at a 38-token prompt, docs/speed.md). The decode graphs' rows
            # have a known range; freezing packs the dense weight for those.
            return torch.ops.gramsync.onednn_linear(x, packed.dense, bias, weight.shape[0])
        packed = packed.dense
    if isinstance(packed, QUANTIZED):  # int4 / int8 on CPU: the same op eager and compiled
        return quantized_linear(x, packed, bias)
    if packed is not None and not torch.compiler.is_compiling():
        return packed_linear(x, packed, bias)
    if use_gemv(x, weight):
        y = small_linear(x, weight)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, weight, bias)
