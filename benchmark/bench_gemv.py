"""The small-batch GEMV alone: gramsync::small_linear against torch's packed library path.

    .venv/bin/python benchmark/bench_gemv.py [--rows 1,2,4,8,16] [--dtype auto] [--rounds 5]

SmolLM2-135M's 121 matmuls of a decode step (30 layers of qkv / o / gate_up / down, then
the tied LM head; random weights of the real shapes, read once per pass, so nothing stays
in cache), at each row count, through:
- ours: ``gramsync::small_linear`` on weights packed by ``cpu_gemv.pack_weight`` (what the
  compiled small-batch graphs call);
- the library: what Inductor's ``freezing`` emits for a linear on CPU: MKL's packed sgemm
  for fp32 (``mkl._mkl_linear``), oneDNN's packed GEMM for bf16 (``mkldnn._linear_pointwise``).
Rounds alternate the two paths; each prints the medians, the read rate, the ratio to the
library and to this run's ``x.sum()`` read floor, with the CPU flags and dtype.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from machine_floor import cpu_flags, cpu_model, read_bandwidth_gbs, timed_runs

HIDDEN, INTER, Q, KV, VOCAB, LAYERS = 576, 1536, 576, 192, 49152, 30
SHAPES = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]


def _libraries(weights: list[torch.Tensor], dtype: torch.dtype, rows: int) -> dict:
    """The packed paths Inductor's freezing may emit for a CPU linear: oneDNN's (bf16, and
    fp32 without MKL) and MKL's packed sgemm (fp32)."""
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
    libs = {"oneDNN": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")}
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        libs["MKL"] = lambda x, i: torch.ops.mkl._mkl_linear(x, mkl[i], weights[i], None, rows)
    return libs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, ".")
    from srt.layers import cpu_gemv
    from srt.layers.cpu_kernels import load_cpu_kernels
    from srt.model_executor.model_runner import cpu_has_native_bf16

    dtype = (torch.bfloat16 if cpu_has_native_bf16() else torch.float32) if args.dtype == "auto" else getattr(torch, args.dtype)
    flags = " ".join(k for k, v in cpu_flags().items() if v)
    print(f"machine: {cpu_model()} | flags: {flags} | dtype {str(dtype).removeprefix('torch.')} "
          f"| threads {torch.get_num_threads()}")
    if not (cpu_gemv.cpu_runs(dtype) and load_cpu_kernels()):
        print(f"no gramsync GEMV for {dtype} on this CPU; nothing to compare")
        return
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in SHAPES]
    ours = [cpu_gemv.pack_weight(w) for w in weights]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{len(weights)} matmuls, {mb:.0f} MB of weights per pass")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {k for _, k in SHAPES}}
        paths = {"ours": lambda x, i: torch.ops.gramsync.small_linear(x, ours[i]),
                 **_libraries(weights, dtype, rows)}
        for i in (0, len(weights) - 1):  # the same numbers before timing anything
            want = xs[SHAPES[i][1]].double() @ weights[i].double().T
            for name, f in paths.items():
                got = f(xs[SHAPES[i][1]], i).double()
                assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (name, rows, i, (got - want).abs().max())
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):  # paths alternate within each round
            for name, f in paths.items():
                times[name].append(statistics.median(timed_runs(
                    lambda: [f(xs[SHAPES[i][1]], i) for i in range(len(weights))], 3)))
        read = read_bandwidth_gbs()
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        best = min((n for n in ms if n != "ours"), key=ms.get)
        libs = " | ".join(f"{n} {ms[n]:6.2f} ms" for n in ms if n != "ours")
        print(f"rows {rows:2d}: ours {ms['ours']:6.2f} ms ({mb / ms['ours']:5.1f} GB/s) | {libs} | "
              f"ours / {best} {ms['ours'] / ms[best]:.2f}x | read {read:.1f} GB/s, "
              f"ours / read floor {ms['ours'] / (mb / read):.2f}x")


if __name__ == "__main__":
    main()
