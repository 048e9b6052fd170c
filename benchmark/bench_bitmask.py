"""Token-bitmask micro-benchmark on CPU: our apply_token_bitmask_inplace vs xgrammar's.

    .venv/bin/python benchmark/bench_bitmask.py [--batch-sizes 1,8,64] [--vocabs 49152,248320]
        [--masks random,sparse,dense] [--repeats 7] [--threads N]

Both sides mask the same fp32 logits [B, V] with the same int32 bitmask [B, ceil(V/32)] in
the same run; each repeat times one call of each, alternating, on a fresh copy of the
logits (copying is not timed). Times are medians over --repeats after one warm-up call each;
"ratio" is ref / ours (> 1: ours is faster). Outputs are checked to be bit-identical.
Masks: "random": every bit a coin flip; "sparse": 16 allowed tokens per row (a grammar at a
keyword or a number); "dense": all but 16 tokens allowed (free text minus a few stop
tokens): xgrammar skips all-ones words in C, ours pays a few torch ops per row (no goal).
``run_bitmask_bench(repeats)`` returns the rows for other benchmarks to print.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from constrained.bitmask_ops import allocate_token_bitmask, apply_token_bitmask_inplace

MASK_KINDS = ("random", "sparse", "dense")
FEW = 16  # tokens allowed (sparse) or disallowed (dense) per row


def make_bitmask(kind: str, b: int, v: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randint(-2**31, 2**31, (b, (v + 31) // 32), dtype=torch.int32, generator=gen)
    allowed = torch.zeros(b, (v + 31) // 32 * 32, dtype=torch.bool)
    few = torch.stack([torch.randperm(v, generator=gen)[:FEW] for _ in range(b)])
    allowed.scatter_(1, few, True)
    if kind == "dense":
        allowed[:, :v] = ~allowed[:, :v]
    weights = 1 << torch.arange(32, dtype=torch.int64)  # pack little-endian, wrap to int32
    packed = (allowed.view(b, -1, 32).long() * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _reset(x: torch.Tensor, logits: torch.Tensor) -> None:
    """x[:] = logits in pieces of 32768 elements, which torch copies on this thread: a
    bigger copy wakes its worker thread, which then spins into the timed call and, with
    another process on the second core, takes CPU time from whichever side runs next."""
    for dst, src in zip(x.view(-1).split(32768), logits.view(-1).split(32768)):
        dst.copy_(src)


def _time_pair(fns, logits: torch.Tensor, mask: torch.Tensor, repeats: int) -> list[float]:
    """Median ms of each fn(x, mask), alternating the fns, x a fresh copy of logits."""
    x = torch.empty_like(logits)
    times = [[] for _ in fns]
    for i in range(repeats + 1):
        for fn, ts in zip(fns, times):
            _reset(x, logits)
            t0 = time.perf_counter()
            fn(x, mask)
            if i:  # the first round is the warm-up
                ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


def run_bitmask_bench(repeats: int = 7, batch_sizes=(1, 8, 64), vocabs=(49152, 248320),
                      masks=MASK_KINDS) -> list[dict]:
    """One dict per (vocab, batch, mask kind): batch, vocab, mask, ref_ms, ours_ms, ratio."""
    import xgrammar

    def ref(x, m):
        xgrammar.apply_token_bitmask_inplace(x, m)

    rows = []
    for v in vocabs:
        for b in batch_sizes:
            gen = torch.Generator().manual_seed(b * 7 + v)
            logits = torch.randn(b, v, generator=gen) * 2.0
            for kind in masks:
                mask = make_bitmask(kind, b, v, gen)
                want, got = logits.clone(), logits.clone()
                ref(want, mask)
                apply_token_bitmask_inplace(got, mask)
                assert torch.equal(want.view(torch.int32), got.view(torch.int32)), (b, v, kind)
                ms_ref, ms_ours = _time_pair([ref, apply_token_bitmask_inplace], logits, mask,
                                             repeats)
                rows.append(dict(batch=b, vocab=v, mask=kind, ref_ms=ms_ref, ours_ms=ms_ours,
                                 ratio=ms_ref / ms_ours))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'B':>4} {'V':>7} {'mask':<7} {'ref ms':>9} {'ours ms':>9} {'ratio':>7}")
    for r in rows:
        print(f"{r['batch']:>4} {r['vocab']:>7} {r['mask']:<7} {r['ref_ms']:>9.3f} "
              f"{r['ours_ms']:>9.3f} {r['ratio']:>6.1f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--vocabs", default="49152,248320")
    ap.add_argument("--masks", default=",".join(MASK_KINDS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--torch-path", action="store_true",
                    help="time our torch-ops path, not the C++ op a scheduler uses once its kernels are loaded")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.torch_path:
        from srt.layers.cpu_kernels import load_cpu_kernels

        load_cpu_kernels()
    from constrained import bitmask_ops

    if args.torch_path:
        bitmask_ops._native_op = lambda: None
    ours = "C++ op (constrained/bitmask_cpu.cpp)" if bitmask_ops._native_op() else "torch ops"
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; ours = {ours}; ref = "
          f"xgrammar.apply_token_bitmask_inplace (CPU); median of {args.repeats} after a warm-up\n")
    rows = run_bitmask_bench(args.repeats, [int(x) for x in args.batch_sizes.split(",")],
                             [int(x) for x in args.vocabs.split(",")], args.masks.split(","))
    print_rows(rows)
    goal = [r for r in rows if r["mask"] in ("random", "sparse")]
    slower = [r for r in goal if r["ratio"] < 1.0]
    print(f"\ngoal: not slower than xgrammar on random and sparse masks: "
          f"{'met' if goal and not slower else f'NOT met in {len(slower)} of {len(goal)} rows'}")


if __name__ == "__main__":
    main()
