"""Decode attention: gramsync's op (cpu_decode_attention.cpp) against the torch path.

    .venv/bin/python benchmark/bench_decode_attention.py [--dtype bfloat16|float32|both] [--served 1,4,16]

Alone, one run, the same tensors: SmolLM2-135M's attention shape (9 query heads over 3 KV heads of
64), 30 layers' pools of the model's size, each row's keys in consecutive slots as the
allocator mostly hands them out, and the torch path both eager and under ``torch.compile``
(what the compiled decode graphs ran before the op). Prints one line per shape with the
three times (ms for the 30 layers, median of 7) and the op's ratio to the compiled torch path.

``--served``: the served decode step as bench_offline measures it (the in-process scheduler,
the compiled steps, chat prompts, 48 greedy tokens), from two schedulers in one process whose
packages were built with ``GRAMSYNC_CPU_DECODE_ATTENTION`` 1 and 0, alternating over 5 rounds;
one line per batch size with both medians and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import machine_floor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from srt.layers.attention.torch_native import decode_attention_torch  # noqa: E402
from srt.layers.cpu_kernels import load_cpu_kernels  # noqa: E402

LAYERS, H, KVH, D, POOL = 30, 9, 3, 64, 8192
SHAPES = [(1, 128), (4, 128), (8, 128), (16, 128), (16, 512), (1, 2048)]


def _median_ms(fn, args_per_layer, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for args in args_per_layer:
            fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:]) * 1e3


def run(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(KVH, POOL, D, generator=g).to(dtype), torch.randn(KVH, POOL, D, generator=g).to(dtype))
             for _ in range(LAYERS)]
    compiled = torch.compile(decode_attention_torch, dynamic=False)
    op = torch.ops.gramsync.decode_attention
    for rows, keys in SHAPES:
        q = torch.randn(rows, H, D, generator=g).to(dtype)
        slots = (torch.arange(rows).unsqueeze(1) * keys + torch.arange(keys).unsqueeze(0)) % POOL
        valid = torch.ones(rows, keys, dtype=torch.bool)
        ours = _median_ms(op, [(q, k, v, slots, valid, D ** -0.5) for k, v in pools])
        torch_args = [(q, k, v, slots, valid, KVH, D ** -0.5) for k, v in pools]
        eager = _median_ms(decode_attention_torch, torch_args)
        comp = _median_ms(compiled, torch_args)
        print(f"decode attention {str(dtype).removeprefix('torch.')} rows={rows} keys={keys}: op {ours:.2f} ms, "
              f"torch eager {eager:.2f} ms, torch compiled {comp:.2f} ms; op vs compiled: ratio {ours / comp:.2f}x")


def served(dtype: str, levels: list[int], rounds: int = 5) -> None:
    import step_breakdown
    from bench_offline import chat_prompts
    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    model_dir = resolve_model_path(None)
    tok = get_tokenizer(model_dir)
    prompts = [apply_chat_template(tok, m) for m in chat_prompts(max(levels))]
    scheds = {}
    for on in ("1", "0"):  # the switch is read while the packages are traced (and in their key)
        os.environ["GRAMSYNC_CPU_DECODE_ATTENTION"] = on
        scheds[on] = step_breakdown.make_scheduler(model_dir, dtype, max(levels))
    for c in levels:
        steps = {"1": [], "0": []}
        for _ in range(rounds):
            for on, sched in scheds.items():
                steps[on].append(step_breakdown.breakdown(sched, prompts, c, 48, eager_split=False)["step_ms"])
        a, b = statistics.median(steps["1"]), statistics.median(steps["0"])
        print(f"served step {dtype} bs={c}: op {a:.2f} ms, torch path {b:.2f} ms; ratio {a / b:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="both", choices=["bfloat16", "float32", "both"])
    ap.add_argument("--served", default="", help="batch sizes for the served-step A/B, e.g. 1,4,16")
    args = ap.parse_args()
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    if not load_cpu_kernels():
        sys.exit("gramsync's CPU kernels could not be built here (no C++ compiler?)")
    torch._dynamo.config.recompile_limit = 64  # one graph per shape, as the served graphs have
    print(f"cpu: {machine_floor.cpu_model()}; flags {' '.join(f for f, on in machine_floor.cpu_flags().items() if on)}; "
          f"threads {torch.get_num_threads()}")
    for name in (["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]):
        with torch.inference_mode():
            if args.served:
                served(name, [int(c) for c in args.served.split(",")])
            else:
                run(getattr(torch, name))


if __name__ == "__main__":
    main()
