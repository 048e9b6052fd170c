"""This machine's physical floors, measured in the same run as the benchmark.

- read bandwidth: summing a tensor far larger than the caches (GB/s);
- matmul peak: a large square matmul in the serving dtype (GFLOP/s);
and the model's decode floors from them: batch 1 reads every weight once (bytes /
bandwidth), a large batch is compute (2 x params x batch FLOPs / peak).
"""
from __future__ import annotations

import time

import torch


def cpu_flags() -> dict[str, bool]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        flags = set()
    return {k: k in flags for k in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def timed_runs(fn, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _best(fn, repeats: int) -> float:
    return min(timed_runs(fn, repeats))


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _best(lambda: x.sum(), repeats) / 1e9


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """The best rate any path here reaches: torch's matmul (MKL on CPU), oneDNN on a packed
    weight (faster on AMD CPUs), and for bf16 also fp32's rate: a CPU without native bf16
    (AVX2) computes bf16 weights at best at its fp32 rate after converting them, and
    measuring only its emulated bf16 matmul (~0.3 GFLOP/s) would make the floor meaningless."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    rates = [2 * n ** 3 / _best(lambda: a @ b, repeats) / 1e9]
    if torch.backends.mkldnn.is_available() and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
        rates.append(2 * n ** 3 / _best(lambda: torch.ops.mkldnn._linear_pointwise(
            a, packed, None, "none", [], ""), repeats) / 1e9)
    if dtype == torch.bfloat16:
        rates.append(matmul_peak_gflops(torch.float32, n, repeats))
    return max(rates)


def _quantized_bytes(model: torch.nn.Module) -> dict[int, int]:
    """id(dense weight) -> bytes a batch-1 step reads instead, per quantized layer."""
    from srt.layers.cpu_qgemv import SmallBatchQuantized

    out = {}
    for m in model.modules():
        held = getattr(m, "packed_weight", None)
        if isinstance(held, SmallBatchQuantized):
            out[id(m.weight)] = sum(t.numel() * t.element_size() for t in held.quantized if isinstance(t, torch.Tensor))
    return out


def model_floors(model: torch.nn.Module, dtype: torch.dtype, bandwidth_gbs: float,
                 peak_gflops: float) -> dict:
    """Decode floors in ms: batch 1 = bytes of weights read per token (the tied LM head
    counted once, as it is read once; a layer that serves small steps from quantized weights,
    e.g. a GGUF's codes, counted at those) / bandwidth; batch b = 2 x matmul params x b / peak."""
    params = {id(p): p for p in model.parameters()}.values()
    read = {id(p): p.numel() * p.element_size() for p in params}
    read.update(_quantized_bytes(model))
    weight_bytes = sum(read.values())
    embed = model.model.embed_tokens.weight
    # Matmul params: every weight but norms; the embedding table is read one row per
    # token, so it counts as a matmul only through the LM head (tied or not).
    matmul_params = sum(p.numel() for p in params if p.dim() == 2)
    if not model.config.tie_word_embeddings:
        matmul_params -= embed.numel()
    return {"weight_bytes": weight_bytes, "matmul_params": matmul_params,
            "batch1_ms": 1e3 * weight_bytes / (bandwidth_gbs * 1e9),
            "per_row_gflop": 2 * matmul_params / 1e9,
            "compute_ms_per_row": 1e3 * 2 * matmul_params / (peak_gflops * 1e9)}
