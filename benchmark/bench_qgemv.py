"""Our quantized GEMVs (srt/layers/cpu_qgemv.cpp) against torch's int4 / int8 CPU kernels,
our bf16 GEMV and oneDNN's packed bf16 linear (the dense path above 16 rows), on SmolLM2's matrices, with the weights streaming from memory as in a served
step (``--copies`` copies of each matrix taken in turn, more than the caches hold).

    .venv/bin/python benchmark/bench_qgemv.py [--rows 1,2,4,8,16] [--copies 30] [--repeats 7]

Prints us per call (medians), one line per matrix and row count, and the four decoder
matrices' sum over 30 layers with the ratio ours / torch (lower is better):
``qgemv rows=<m> int4 <ours> vs <torch> ms (<x>x) int8 <ours> vs <torch> ms (<x>x)``.
Needs AVX512-BF16 (the ops' only build); elsewhere it says so and exits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import machine_floor

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def per_call_us(fn, weights, x, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(x, w)
        runs.append((time.perf_counter() - t) / len(weights))
    return 1e6 * statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    from srt.layers.cpu_gemv import cpu_runs, pack_weight
    from srt.layers.cpu_int4_linear import int4_from_codes
    from srt.layers.cpu_int8_linear import quantize_int8
    from srt.layers.cpu_kernels import load_cpu_kernels
    from srt.layers.cpu_packed_linear import pack_weight as pack_onednn
    from srt.layers.cpu_packed_linear import packed_linear
    from srt.layers.cpu_qgemv import pack_int4, pack_int8

    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} threads={torch.get_num_threads()} "
          "activations=bfloat16")
    if not (cpu_runs(torch.bfloat16) and load_cpu_kernels()):
        raise SystemExit("our quantized GEMVs need AVX512-BF16 and a C++ compiler; nothing to compare here")
    rows = [int(r) for r in args.rows.split(",")]
    sums = {m: dict.fromkeys(("int4", "torch_int4", "int8", "torch_int8"), 0.0) for m in rows}
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(2, args.copies // 5) if name == "lm_head" else args.copies
        codes = [torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8) for _ in range(copies)]
        scale = (torch.rand(n, k // 32, generator=g) * 0.01).bfloat16()
        zero = (torch.randn(n, k // 32, generator=g) * 0.01).bfloat16()
        ours4 = [pack_int4(c, scale, zero).wp for c in codes]
        torch4 = [int4_from_codes(c, scale, zero, 32) for c in codes]
        del codes
        q8 = [quantize_int8(torch.randn(n, k, generator=g)) for _ in range(copies)]
        ours8 = [pack_int8(q.qdata, q.scales) for q in q8]
        dense_w = [torch.randn(n, k, generator=g).bfloat16() for _ in range(copies)]
        dense = [pack_weight(w) for w in dense_w]
        onednn = [pack_onednn(w) for w in dense_w]
        del dense_w
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            t = {"int4": per_call_us(lambda x, w: torch.ops.gramsync.int4_linear(x, w), ours4, x, args.repeats),
                 "torch_int4": per_call_us(lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
                     x, w.qdata, 32, w.scale_and_zero), torch4, x, args.repeats),
                 "int8": per_call_us(lambda x, w: torch.ops.gramsync.int8_linear(x, w.wp, w.scale), ours8, x,
                                     args.repeats),
                 "torch_int8": per_call_us(lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w.qdata, w.scales),
                                           q8, x, args.repeats),
                 "bf16_gemv": per_call_us(lambda x, w: torch.ops.gramsync.small_linear(x, w), dense, x, args.repeats),
                 "onednn_bf16": per_call_us(lambda x, w: packed_linear(x, w, None), onednn, x, args.repeats)}
            print(f"{name:8s} {n}x{k} rows={m:2d} us: " + "  ".join(f"{k_} {v:7.1f}" for k_, v in t.items()))
            if name != "lm_head":
                for key in sums[m]:
                    sums[m][key] += LAYERS * t[key] / 1e3
        del ours4, torch4, q8, ours8, dense, onednn
    print(f"\n{LAYERS} layers x {len(SHAPES) - 1} decoder matrices, ms per step's matmuls")
    for m, s in sums.items():
        print(f"qgemv rows={m} int4 {s['int4']:.2f} vs {s['torch_int4']:.2f} ms ({s['int4'] / s['torch_int4']:.2f}x) "
              f"int8 {s['int8']:.2f} vs {s['torch_int8']:.2f} ms ({s['int8'] / s['torch_int8']:.2f}x)")


if __name__ == "__main__":
    main()
