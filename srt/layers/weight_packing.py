"""Walks over a loaded model that give its linear layers and LM head their CPU weights:
oneDNN-packed (cpu_packed_linear.py), int4 (cpu_int4_linear.py), int8 (cpu_int8_linear.py).

Apart from those kernels' modules because it knows the layer classes, which import the
kernels: the kernels do not import the layers back.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from srt.layers.cpu_int4_linear import quantize_int4
from srt.layers.cpu_qgemv import SmallBatchQuantized
from srt.layers.cpu_int8_linear import quantize_int8
from srt.layers.cpu_packed_linear import pack_weight, packing_supported
from srt.layers.linear import _TPLinear
from srt.layers.vocab_parallel_embedding import ParallelLMHead

logger = logging.getLogger(__name__)


def pack_linear_weights(model: nn.Module, dtype: torch.dtype, log_prefix: str,
                        compiled: bool = False) -> int:
    """Give every linear layer and the LM head its weight packed. A linear layer's dense
    weight becomes a meta tensor (shape and dtype kept, no memory): only a compiled step or
    torchao would read it, and neither runs on a packed model. A GGUF's codes layer
    (``SmallBatchQuantized``) gets its dense rows packed beside them. The LM head keeps its dense
    weight (a tied embedding reads it). Returns the number of layers packed.

    ``compiled``: the model also runs compiled steps; only a GGUF's codes layers get their
    dense rows packed (for the compiled prefill and eager steps), and every dense weight
    stays (the decode graphs' freezing packs its own from it)."""
    if not packing_supported(dtype):
        return 0
    count = 0
    for module in model.modules():
        if not (isinstance(module, (_TPLinear, ParallelLMHead)) and module.weight.dtype == dtype):
            continue
        held = getattr(module, "packed_weight", None)
        if held is None and not compiled:
            module.packed_weight = pack_weight(module.weight)
        elif isinstance(held, SmallBatchQuantized) and held.dense is None:  # a GGUF's codes: the dense rows
            module.packed_weight = held._replace(dense=pack_weight(module.weight))
        else:
            continue  # int4 / int8 layers keep theirs
        if isinstance(module, _TPLinear) and not compiled:
            module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
        count += 1
    logger.info("%s oneDNN-packed weights for %d %s linear layers", log_prefix, count,
                "GGUF-coded (dense rows, the prefill and eager steps)" if compiled else "eager")
    return count


def quantize_model_int4(model: nn.Module, group: int, log_prefix: str, head: bool = True) -> int:
    """Every linear layer and the LM head get an ``Int4Weight`` in ``packed_weight``; a
    linear layer's dense weight becomes a meta tensor (shape and dtype kept, no memory).
    ValueError where a layer's input size is not a multiple of ``group``."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, _TPLinear) and not (head and isinstance(module, ParallelLMHead)):
            continue
        if module.weight.shape[1] % group:
            raise ValueError(f"--torchao-config int4wo-{group}: {name} has {module.weight.shape[1]} inputs, "
                             f"not a multiple of the group size {group}")
        module.packed_weight = quantize_int4(module.weight, group)
        if isinstance(module, _TPLinear):
            module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
        count += 1
    logger.info("%s int4 weights (group %d, torch's CPU int4 kernel) for %d linear layers",
                log_prefix, group, count)
    return count


def quantize_head_int8(model: nn.Module, log_prefix: str) -> int:
    """The LM head gets int8 weights (one scale per row) for steps of up to
    ``HEAD_INT8_MAX_ROWS`` rows, in a ``SmallBatchQuantized``: for our int8 GEMV
    (cpu_qgemv.py) where the CPU runs it, else torch's kernel; its dense weight serves larger
    steps (both int8 kernels turn compute-bound within a few rows: torch's took 51.6 ms at 64
    rows where oneDNN's bf16 took 9.7) and a tied embedding. Returns the number of heads
    quantized (0 or 1 per rank)."""
    from srt.layers.cpu_gemv import gemv_max_rows
    from srt.layers.cpu_qgemv import HEAD_INT8_MAX_ROWS, fits, pack_int8, qgemv_available

    count, ours = 0, False
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            q = quantize_int8(module.weight)
            ours = qgemv_available() and fits(*module.weight.shape)
            # The same bf16-rounded scales either way: the same weights.
            rows = min(HEAD_INT8_MAX_ROWS, gemv_max_rows(torch.bfloat16)) if ours else HEAD_INT8_MAX_ROWS
            module.packed_weight = SmallBatchQuantized(pack_int8(q.qdata, q.scales) if ours else q, None, rows)
            count += 1
    logger.info("%s int8 LM head (%s, one scale per row) in steps of up to %d rows", log_prefix,
                "gramsync's int8 GEMV" if ours else "torch's CPU int8 kernel",
                rows if count else HEAD_INT8_MAX_ROWS)
    return count
