"""Where a compiled decode step's time goes, inside the package (CPU).

step_breakdown.py splits the *eager* forward by module hooks; a compiled step is one
fused graph with no module boundaries. This runs the served (compiled) decode steps of the
in-process scheduler under ``torch.profiler`` with Inductor's per-kernel profiling on
(``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1``, set by ``--package-profile`` before
anything compiles; those packages are kept in a folder of their own), and sums every
event the package runs into a few parts, ms per step:

- ``gemv``: our small-batch GEMV (``gramsync::small_linear``), every weight matmul up to 16 rows
- ``gemm``: other weight matmuls (oneDNN / MKL / the C++ GEMM template; the 17-64 graph)
- ``attn_bmm``: attention's two batched matmuls per layer
- ``fused``: Inductor's own C++ kernels (gather + rotary + KV write, softmax, norms, SiLU)
- ``other``: any other op the package calls
- ``untraced``: the step's wall time outside all of these (launch, Python, the scheduler)

Kernel profiling adds a little time to every fused kernel: compare parts within a run.
"""
from __future__ import annotations

import statistics
import time

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::", "onednn::", "cpp_CppMicroGemm",
            "mkl_linear", "_mkl_linear", "cpp_fused_mm", "cpp_fused_addmm")
PARTS = ("gemv", "gemm", "attn_bmm", "fused", "other", "untraced")


def part_of(name: str) -> str:
    if name == "gramsync::small_linear":  # (fused kernels around it carry its name too)
        return "gemv"
    if "bmm" in name or "baddbmm" in name:
        return "attn_bmm"
    if any(op in name for op in GEMM_OPS):
        return "gemm"
    if "cpp_fused" in name or "cpp_kernel" in name:
        return "fused"
    return "other"


def profile_decode(sched, prompts_ids, concurrency: int, new_tokens: int) -> dict:
    """ms per served decode step in each part (``PARTS``), and the step's median."""
    from torch.profiler import ProfilerActivity, profile

    from step_breakdown import _decode

    batch = [prompts_ids[i % len(prompts_ids)] for i in range(concurrency)]
    _decode(sched, batch, 4, f"pwarm{concurrency}")
    box = {}

    def start():
        box["prof"] = profile(activities=[ProfilerActivity.CPU])
        box["prof"].__enter__()
        box["t0"] = time.perf_counter()

    steps = _decode(sched, batch, new_tokens, f"p{concurrency}", on_decode_start=start)
    wall = time.perf_counter() - box["t0"]
    box["prof"].__exit__(None, None, None)
    parts = dict.fromkeys(PARTS, 0.0)
    names: dict[str, float] = {}
    for e in box["prof"].key_averages():  # self time: each microsecond counted once
        part = part_of(e.key)
        if part == "other" and "::" not in e.key and not e.key.startswith("aoti_"):
            continue  # Python-side ranges (the profiler's own, the scheduler's): left in untraced
        parts[part] += e.self_cpu_time_total / 1e3
        names[e.key] = names.get(e.key, 0.0) + e.self_cpu_time_total / 1e3
    n = len(steps)
    parts = {k: v / n for k, v in parts.items()}
    parts["untraced"] = max(0.0, 1e3 * wall / n - sum(parts.values()))
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {"concurrency": concurrency, "step_ms": 1e3 * statistics.median(steps), "parts_ms": parts,
            "top": [(name, ms / n) for name, ms in top]}


def print_profile(rows) -> None:
    print("\ninside the compiled decode step, ms per step (torch.profiler, Inductor kernel profile on)")
    print(" conc    step " + " ".join(f"{p:>8}" for p in PARTS))
    for r in rows:
        print(f"{r['concurrency']:>5} {r['step_ms']:>7.1f} "
              + " ".join(f"{r['parts_ms'][p]:>8.2f}" for p in PARTS))
    for r in rows:
        print(f"  top kernels at {r['concurrency']}: "
              + "; ".join(f"{name[:48]} {ms:.2f}" for name, ms in r["top"]))
