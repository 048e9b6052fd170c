"""Can a batch-1 bf16 decode read its weights faster than the library paths? A probe.

    .venv/bin/python benchmark/bench_gemv_probe.py [--inductor]

SmolLM2-135M's matmuls at one row (30 layers of qkv / o / gate_up / down, then the tied
LM head; 269 MB of bf16 weights, each read once per "token", so nothing stays in cache)
through:
- oneDNN's linear on weights packed once (the library path of the eager step);
- with --inductor, torch.compile with freezing and max-autotune (the compiled step's path:
  Inductor's C++ GEMM template, AMX micro-kernel on AMX CPUs; ~2 minutes to compile), each
  layer's matmuls reading one input; with --chained also chained as in a model;
- a hand-written GEMV (AVX512-BF16 ``vdpbf16ps``, both cores) on row-major weights;
- the same GEMV on weights re-laid as 16-row x 32-column tiles stored in reading order.
It prints each path's time and read rate against this run's ``x.sum()`` read rate, and
the tiled GEMV's ratio to the best library path. Needs AVX512-BF16 and a C++ compiler
(the one Inductor uses); elsewhere it says so and exits. Not used by the server: it is
the measurement behind docs/speed-history.md's "bf16 on an AVX512-BF16 / AMX Xeon".
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from machine_floor import cpu_flags, cpu_model, read_bandwidth_gbs, timed_runs

_SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
// y[n] = sum_k w[n, k] x[k]; w row-major [N, K] bf16, four rows per iteration.
torch::Tensor gemv_rows(torch::Tensor w, torch::Tensor x) {
  int64_t N = w.size(0), K = w.size(1);
  auto y = torch::empty({N}, torch::dtype(torch::kFloat32));
  const uint16_t* W = (const uint16_t*)w.data_ptr();
  const uint16_t* X = (const uint16_t*)x.data_ptr();
  float* Y = y.data_ptr<float>();
  #pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; n += 4) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(X + k);
      for (int r = 0; r < 4; r++)
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(W + (n + r) * K + k), xv);
    }
    for (int r = 0; r < 4; r++) Y[n + r] = _mm512_reduce_add_ps(a[r]);
  }
  return y;
}
// The same on tiles: wt [N/16, K/32, 16, 32], so the loop reads memory in order.
torch::Tensor gemv_tiled(torch::Tensor wt, torch::Tensor x) {
  int64_t NB = wt.size(0), KB = wt.size(1);
  auto y = torch::empty({NB * 16}, torch::dtype(torch::kFloat32));
  const uint16_t* W = (const uint16_t*)wt.data_ptr();
  const uint16_t* X = (const uint16_t*)x.data_ptr();
  float* Y = y.data_ptr<float>();
  #pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < NB; nb++) {
    const uint16_t* t = W + nb * KB * 512;
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < KB; kb++) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(X + kb * 32);
      const uint16_t* tk = t + kb * 512;
      _mm_prefetch((const char*)(tk + 2048), _MM_HINT_T0);
      _mm_prefetch((const char*)(tk + 2048 + 256), _MM_HINT_T0);
      for (int r = 0; r < 16; r++) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(tk + r * 32), xv);
    }
    for (int r = 0; r < 16; r++) Y[nb * 16 + r] = _mm512_reduce_add_ps(acc[r]);
  }
  return y;
}
"""
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def _median_ms(fn, repeats: int) -> float:
    return 1e3 * statistics.median(timed_runs(fn, repeats, warmup=3))


def _tile(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // 16, 16, k // 32, 32).transpose(1, 2).contiguous()


def _inductor_path(weights, head, x, chained: bool):
    """The compiled step's GEMMs: one module, frozen, max-autotune (CPP template vs ATen).
    ``chained``: each matmul reads the previous one's output (residual adds, slices), as in
    a model; otherwise every matmul of a layer reads the same input."""
    mods = [torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16) for w in weights + [head]]
    for m, w in zip(mods, weights + [head]):
        m.weight.data = w
    seq = torch.nn.ModuleList(mods).eval()

    def forward(v):
        outs = []
        for i in range(LAYERS):
            qkv, o, gu, down = seq[4 * i: 4 * i + 4]
            if chained:
                v = v + o(qkv(v)[:, :HIDDEN])
                g = gu(v)
                v = v + down(g[:, :1536] * g[:, 1536:])
            else:
                outs += [qkv(v), o(v), down(gu(v)[:, :1536])]
        return outs, seq[-1](v)

    with torch._inductor.config.patch(freezing=True):
        compiled = torch.compile(forward, options={"freezing": True, "max_autotune": True,
                                                   "max_autotune_gemm_backends": "CPP,ATEN"})
        compiled(x[None])

    def run():
        with torch._inductor.config.patch(freezing=True):
            compiled(x[None])
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inductor", action="store_true", help="also time the compiled step's path (~2 min)")
    ap.add_argument("--chained", action="store_true",
                    help="also time the compiled matmuls chained as in a model (another ~2 min)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    flags = cpu_flags()
    print(f"cpu={cpu_model()} flags={flags} dtype=bfloat16 threads={torch.get_num_threads()}")
    if not flags["avx512_bf16"]:
        sys.exit("this probe needs AVX512-BF16")
    from torch.utils.cpp_extension import load_inline
    ext = load_inline("gramsync_gemv_probe", cpp_sources=_SRC, functions=["gemv_rows", "gemv_tiled"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for _ in range(LAYERS) for n, k in SHAPES]
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16) * 0.05
    nbytes = sum(w.nbytes for w in weights) + head.nbytes
    xs = {576: torch.randn(576, dtype=torch.bfloat16), 1536: torch.randn(1536, dtype=torch.bfloat16)}
    tiled = [_tile(w) for w in weights + [head]]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights + [head]]
    for w, t in ((weights[3], tiled[3]), (head, tiled[-1])):  # both kernels against F.linear
        ref = torch.nn.functional.linear(xs[w.shape[1]].float(), w.float())
        for out in (ext.gemv_rows(w, xs[w.shape[1]]), ext.gemv_tiled(t, xs[w.shape[1]])):
            torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    paths = {
        "oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[p.size(1)][None], p, None, "none", [], "")
                                  for p in packed],
        "GEMV row-major": lambda: [ext.gemv_rows(w, xs[w.shape[1]]) for w in weights + [head]],
        "GEMV tiled": lambda: [ext.gemv_tiled(t, xs[t.shape[1] * 32]) for t in tiled],
    }
    if args.inductor:
        paths["Inductor template"] = _inductor_path(weights, head, xs[576], chained=False)
    if args.chained:
        paths["Inductor chained"] = _inductor_path(weights, head, xs[576], chained=True)
    bw = read_bandwidth_gbs()
    print(f"{nbytes / 1e6:.0f} MB of weights; x.sum() reads {bw:.1f} GB/s -> floor {nbytes / bw / 1e6:.2f} ms")
    times = {name: _median_ms(fn, args.repeats) for name, fn in paths.items()}
    for name, ms in times.items():
        print(f"{name:18s} {ms:7.2f} ms  {nbytes / ms / 1e6:5.1f} GB/s")
    best_lib = min(ms for name, ms in times.items() if not name.startswith("GEMV"))
    print(f"GEMV tiled vs best library path: ratio {times['GEMV tiled'] / best_lib:.2f}x (lower: GEMV faster)")


if __name__ == "__main__":
    main()
