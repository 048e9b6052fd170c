"""The routed experts on CPU: our per-expert loop against ``torch._grouped_mm``.

    .venv/bin/python benchmark/bench_moe_cpu.py [--tokens 1,8,64] [--dtypes float32,bfloat16]
                                                [--experts 128] [--rounds 7]

One MoE layer at Qwen3-30B-A3B's shapes (H=2048, I=768, k=8; E=128 by default, fewer with
--experts to fit a small machine), random weights and router choices (uniform over the
experts, seeded), through ``moe_experts_loop`` (one F.linear pair per hit expert) and
``moe_experts_grouped_mm`` (the same grouping, two grouped GEMMs; ``moe_experts_torch``'s
default where it runs). Rounds alternate the two;
each line prints both medians, the ratio loop / grouped_mm (< 1: the loop is faster), the
largest difference between the two, with the CPU flags and dtype.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from machine_floor import cpu_flags, cpu_model, timed_runs

HIDDEN, INTER, TOP_K = 2048, 768, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, ".")
    from srt.layers.moe.experts_torch import moe_experts_grouped_mm, moe_experts_loop

    flags = " ".join(k for k, v in cpu_flags().items() if v)
    print(f"machine: {cpu_model()} | flags: {flags} | threads {torch.get_num_threads()} | "
          f"H={HIDDEN} I={INTER} E={args.experts} k={TOP_K}")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        w13 = (torch.randn(args.experts, 2 * INTER, HIDDEN, generator=g) * 0.02).to(dtype)
        w2 = (torch.randn(args.experts, HIDDEN, INTER, generator=g) * 0.02).to(dtype)
        for t in (int(s) for s in args.tokens.split(",")):
            x = torch.randn(t, HIDDEN, generator=g).to(dtype)
            ids = torch.rand(t, args.experts, generator=g).topk(TOP_K, dim=-1).indices
            weights = torch.softmax(torch.rand(t, TOP_K, generator=g), dim=-1)
            run = {"loop": lambda: moe_experts_loop(x, w13, w2, weights, ids),
                   "grouped_mm": lambda: moe_experts_grouped_mm(x, w13, w2, weights, ids)}
            diff = (run["loop"]().float() - run["grouped_mm"]().float()).abs().max().item()
            times = {k: [] for k in run}
            for _ in range(args.rounds):  # alternate, so drift hits both alike
                for k, fn in run.items():
                    times[k] += timed_runs(fn, repeats=3)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            hit = ids.unique().numel()
            print(f"{name:8s} T={t:3d} ({hit:3d} experts hit): loop {med['loop']:8.2f} ms | "
                  f"grouped_mm {med['grouped_mm']:8.2f} ms | loop/grouped_mm "
                  f"{med['loop'] / med['grouped_mm']:.2f} | max diff {diff:.1e}")
        del w13, w2


if __name__ == "__main__":
    main()
