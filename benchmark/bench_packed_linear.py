"""Eager decode step: linear layers through oneDNN-packed weights vs F.linear (MKL), same run.

    .venv/bin/python benchmark/bench_packed_linear.py [--dtype auto] [--repeats 3]

One in-process scheduler, compile off (the path a server takes with --disable-torch-compile,
with torchao, and in the test suite). Each repeat runs batch 1, 4 and 16 greedy decodes
first with every layer's packed weight unset (F.linear), then set (the default), so both
sides see the same machine state; medians over repeats of each side's median step. Then
the LM head alone (the largest matmul) on both paths, and the eager step's split (linear /
attention / other) from the module timers of step_breakdown.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import step_breakdown
from machine_floor import cpu_flags, cpu_model


def _step_ms(sched, ids, bs: int, tag: str) -> float:
    return statistics.median(step_breakdown._decode(sched, [ids] * bs, 12, tag)) * 1000


def _prefill_ms(sched, ids: list[int], tag: str) -> float:
    """One prompt prefilled (chunked as served), then its single token decoded away."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1})
    sched.process_input_requests([TokenizedGenerateReq(tag, tuple(ids), params)])
    t = time.perf_counter()
    while sched.waiting:
        sched.step()
    elapsed = time.perf_counter() - t
    while sched.running:
        sched.step()
    return elapsed * 1000


def _lm_head_ms(head, rows: int) -> tuple[float, float]:
    x = torch.randn(rows, head.weight.shape[1], dtype=head.weight.dtype)
    out = []
    for packed in (None, head.packed_weight):
        saved, head.packed_weight = head.packed_weight, packed
        head.forward_local(x)
        t = time.perf_counter()
        for _ in range(10):
            head.forward_local(x)
        out.append((time.perf_counter() - t) / 10 * 1000)
        head.packed_weight = saved
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,4,16")
    args = ap.parse_args()
    from srt.layers.cpu_packed_linear import pack_weight, packing_supported
    from srt.layers.linear import _TPLinear
    from srt.layers.vocab_parallel_embedding import ParallelLMHead
    from srt.model_executor.model_loader import resolve_model_path
    from transformers import AutoTokenizer

    path = resolve_model_path(None)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # Loaded unpacked (a packed model drops its dense linear weights), then packed here with
    # the dense weights kept, so one model runs both sides.
    os.environ["GRAMSYNC_CPU_PACKED_LINEAR"] = "0"
    sched = step_breakdown.make_scheduler(path, args.dtype, max(sizes), disable_torch_compile=True)
    dtype = sched.runner.dtype
    if not packing_supported(dtype):
        raise SystemExit(f"no oneDNN packing for {dtype} on this CPU")
    layers = [m for m in sched.runner.model.modules() if isinstance(m, (_TPLinear, ParallelLMHead))]
    packed = [pack_weight(m.weight) for m in layers]
    print(f"cpu {cpu_model()} flags {cpu_flags()} dtype {dtype} "
          f"threads {torch.get_num_threads()} packed layers {len(layers)}")
    ids = AutoTokenizer.from_pretrained(path)("Hello there, how are you")["input_ids"]
    times: dict[tuple[int, str], list[float]] = {}
    for rep in range(args.repeats):
        for side in ("F.linear", "packed"):
            for m, p in zip(layers, packed):
                m.packed_weight = p if side == "packed" else None
            for bs in sizes:
                times.setdefault((bs, side), []).append(_step_ms(sched, ids, bs, f"{side}{rep}-{bs}"))
            long = [rep * 2 + (side == "packed") + 1] + ids * (1000 // len(ids))  # never a cache hit
            times.setdefault(("prefill", side), []).append(_prefill_ms(sched, long, f"p{side}{rep}"))
    for bs in sizes:
        ref, ours = statistics.median(times[(bs, "F.linear")]), statistics.median(times[(bs, "packed")])
        print(f"eager step bs={bs}: F.linear {ref:.1f} ms, packed {ours:.1f} ms, ratio {ref / ours:.2f}x")
    ref, ours = statistics.median(times[("prefill", "F.linear")]), statistics.median(times[("prefill", "packed")])
    print(f"eager prefill of ~1,000 tokens: F.linear {ref:.0f} ms, packed {ours:.0f} ms, ratio {ref / ours:.2f}x")
    head = next(m for m in layers if isinstance(m, ParallelLMHead))
    head.packed_weight = packed[layers.index(head)]
    for rows in (1, 4, 16):
        ref, ours = _lm_head_ms(head, rows)
        print(f"lm head rows={rows}: F.linear {ref:.2f} ms, packed {ours:.2f} ms, ratio {ref / ours:.2f}x")
    for m, p in zip(layers, packed):
        m.packed_weight = p
    for bs in sizes:  # where the packed step's time goes now (the next person starts here)
        row = step_breakdown.breakdown(sched, [ids], bs, 12)
        split = ", ".join(f"{k} {v:.1f} ms" for k, v in row["eager_forward_ms"].items())
        print(f"packed eager step bs={bs}: {row['eager_step_ms']:.1f} ms; forward split: {split}")


if __name__ == "__main__":
    main()
