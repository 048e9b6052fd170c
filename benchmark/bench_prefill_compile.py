"""Compiled prefill vs eager prefill, alternating on one in-process scheduler.

    .venv/bin/python benchmark/bench_prefill_compile.py [--dtype bfloat16] [--rounds 5]
        [--num-prompts 96] [--concurrency 16]

One ``Scheduler`` is built with the server's compile flags (``--enable-torch-compile
--wait-for-torch-compile``: the compiled prefill is ready when it returns); each round
scores the same prompts (bench_scoring.py's, ``max_new_tokens`` 0, prompt logprobs) once
with the compiled prefill and once with it switched off (``runner.compiled_switch.prefill`` set
to None, so ``ModelRunner.forward`` prefills eagerly), in alternating order. Prints each
round's tokens/s, the medians and their ratio; run it once per dtype (the default dtype
follows the CPU: bf16 with avx512_bf16, else fp32).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scoring as bs  # noqa: E402
import machine_floor  # noqa: E402


def main() -> None:
    from srt.model_executor.model_loader import resolve_model_path
    from srt.model_executor.model_runner import resolve_dtype
    from srt.server_args import ServerArgs
    from srt.tokenizer_utils import get_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(min(os.cpu_count() or 1, torch.get_num_threads()))
    dtype = str(resolve_dtype(ServerArgs(dtype=args.dtype), "cpu")).removeprefix("torch.")
    model_dir = resolve_model_path(None)
    prompts = bs.make_prompts(get_tokenizer(model_dir), args.num_prompts, 48, 80, 0)
    n_tokens = sum(map(len, prompts))
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={dtype} "
          f"threads={torch.get_num_threads()} prompts={len(prompts)} tokens={n_tokens}")
    ip = bs.InProcess(model_dir, ["--dtype", dtype, "--enable-torch-compile", "--wait-for-torch-compile"],
                      prompts, args.concurrency)
    runner = ip.sched.runner
    compiled = runner.compiled_prefill
    if compiled is None or not compiled.ready:
        raise SystemExit("the compiled prefill is not in use here (see the warnings above)")
    tok_s: dict[str, list[float]] = {"compiled": [], "eager": []}
    for r in range(args.rounds):
        order = ("compiled", "eager") if r % 2 == 0 else ("eager", "compiled")
        for name in order:
            runner.compiled_switch.prefill = compiled if name == "compiled" else None
            tok_s[name].append(n_tokens / ip.timed_round())
            print(f"  round {r}: {name:<9}{tok_s[name][-1]:8.1f} tok/s", flush=True)
    runner.compiled_switch.prefill = compiled
    if not compiled.ready:
        raise SystemExit("the compiled prefill fell back to eager during the rounds")
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    ahead = sum(c > e for c, e in zip(tok_s["compiled"], tok_s["eager"]))
    print(f"=== {dtype}: compiled {med['compiled']:.1f} tok/s, eager {med['eager']:.1f} tok/s -> "
          f"{med['compiled'] / med['eager']:.3f}x (compiled ahead in {ahead} of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
