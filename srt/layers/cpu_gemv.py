"""A hand-written GEMV for the compiled decode graphs' matmuls at up to 16 rows (CPU).

At a few rows a decode step is a weight read. On an AVX512-BF16 CPU without AMX,
oneDNN's packed bf16 GEMM (what Inductor's ``freezing`` emits) reads SmolLM2's weights at
~54 GB/s where this kernel reads them at ~72 GB/s (121 matmuls, one row: 3.76 against
5.00 ms; docs/speed.md "A GEMV for the small batches"). ``cpu_gemv.cpp`` is the torch op
``gramsync::small_linear``: the weight in 16-row panels, each a contiguous stream
(``pack_weight``), MB rows x up to 8 panels of fp32 accumulators in registers, bf16 by
``vdpbf16ps`` (AVX512-BF16) and fp32 by FMA (AVX512F+BW, or AVX2+FMA with up to 6 rows
per register tile: there it replaces Inductor's C++ GEMM template, 0.78-0.94x its served
step). bf16 without AVX512-BF16 keeps oneDNN (``cpu_runs``). torch.export / AOTInductor packages call it like
any op, through AOTInductor's proxy executor.

It is built (cpu_kernels.py, with the decode-attention op) only where a graph would use
it: the compile builder (nice 19) builds it while tracing, and a rank loads it before it
loads a package.
``GRAMSYNC_CPU_GEMV=0`` keeps the graphs on oneDNN. ``linear`` routes to the op only
inside a trace (eager steps keep oneDNN's packed weights) and only where the rows are
known to be <= 16 (the batch-1 and 2-16 graphs; the 17-64 graph is compute-bound,
where oneDNN is faster).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from srt.layers.cpu_kernels import PANEL, dynamo_constant, load_cpu_kernels

GEMV_MAX_ROWS = 16
# With AMX tiles, oneDNN's bf16 matmul overtakes every GEMV (ours dense, int4 codes, int8
# head) within a few rows: SmolLM2's 120 decoder matmuls, weights streaming (2-vCPU Xeon,
# bench_qgemv.py, 2026-12-05): at 4 rows our int4 6.8 ms against oneDNN's 10.9, at 8 11.9
# against 10.6, at 16 23.4 against 11.9; the LM head at 4 rows int8 2.4 against 2.9 ms, at
# 16 9.0 against 3.1. There the GEMVs serve steps of up to 4 rows.
AMX_GEMV_MAX_ROWS = 4


@dynamo_constant
def gemv_max_rows(dtype: torch.dtype) -> int:
    """Most rows of a step a GEMV serves in the compiled graphs (and the GGUF's codes and the
    int8 head in eager steps): 16, or 4 for bf16 on a CPU with AMX tiles."""
    from srt.model_executor.compiled.cache import cpu_flags

    if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags():
        return AMX_GEMV_MAX_ROWS
    return GEMV_MAX_ROWS


def gemv_wanted() -> bool:
    """The user's switch (``GRAMSYNC_CPU_GEMV``, default on)."""
    from srt.environ import GRAMSYNC_CPU_GEMV

    return GRAMSYNC_CPU_GEMV.get()


def cpu_runs(dtype: torch.dtype) -> bool:
    """This CPU has the instructions the kernel needs for ``dtype``."""
    from srt.model_executor.compiled.cache import cpu_flags

    flags = set(cpu_flags())
    if dtype == torch.float32:
        return {"avx512f", "avx512bw"} <= flags or {"avx2", "fma"} <= flags
    return dtype == torch.bfloat16 and {"avx512f", "avx512bw", "avx512_bf16"} <= flags


@dynamo_constant  # Dynamo calls it, never traces the build
def gemv_available(dtype: torch.dtype) -> bool:
    """The user wants it, this CPU runs ``dtype`` natively and the library is loaded."""
    return gemv_wanted() and cpu_runs(dtype) and load_cpu_kernels()


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inside a trace of a CPU graph whose rows are known to be <= gemv_max_rows, for a
    weight the panels fit (rows a multiple of 16, an even number of columns)."""
    if (weight.device.type != "cpu" or not torch.compiler.is_compiling()
            or weight.dim() != 2 or weight.shape[0] % PANEL or weight.shape[1] % 2):
        return False
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    return statically_known_true(rows <= gemv_max_rows(weight.dtype)) and gemv_available(weight.dtype)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as 16-row panels, each one contiguous stream in the order the kernel
    reads it: bf16 [N/16, K/2, 16, 2] (vdpbf16ps multiplies pairs of columns), fp32
    [N/16, K, 16]. Plain view / permute / copy ops: in a frozen graph the weight is a
    constant, so Inductor's constant folding packs it once at compile time and the package
    holds only the packed copy."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through the kernel (the weight packed on the way: folded in a graph)."""
    return torch.ops.gramsync.small_linear(x, pack_weight(weight))
