"""How close bf16 prompt logprobs are to the fp32 model's: eager prefill, compiled prefill
(``srt/model_executor/compiled/prefill.py``) and transformers, all on the same prompts.

    .venv/bin/python benchmark/bench_scoring_accuracy.py [--num-prompts 32]

bf16 rounding moves every prompt logprob; the question is whether compiling the prefill
moves it further from the model's fp32 values than eager bf16 (or transformers' bf16) does.
Each side scores the same token ids (bench_scoring.py's prompts) on an in-process scheduler
built from the server's flags (the reference: transformers in process); printed: max and
mean |logprob difference| against the fp32 scheduler, and how often the top-1 logprob
agrees within 0.05, then compiled and eager each against transformers' bf16.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scoring as bs  # noqa: E402
import machine_floor  # noqa: E402


def scores(model_dir: str, prompts: list[list[int]], dtype: str, compiled: bool) -> list:
    flags = ["--dtype", dtype] + (["--wait-for-torch-compile", "--enable-torch-compile"] if compiled
                                  else ["--disable-torch-compile"])
    ip = bs.InProcess(model_dir, flags, prompts, 16)
    runner = ip.sched.runner
    if compiled and not (runner.compiled_prefill is not None and runner.compiled_prefill.ready):
        raise SystemExit("the compiled prefill is not in use (see the warnings above)")
    ip.timed_round()
    return ip.results


def main() -> None:
    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import get_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(min(os.cpu_count() or 1, torch.get_num_threads()))
    model_dir = resolve_model_path(None)
    tok = get_tokenizer(model_dir)
    prompts = bs.make_prompts(tok, args.num_prompts, 48, 80, 0)
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} prompts={len(prompts)}")
    fp32 = scores(model_dir, prompts, "float32", False)
    sides = {"eager bf16": scores(model_dir, prompts, "bfloat16", False),
             "compiled bf16": scores(model_dir, prompts, "bfloat16", True)}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    _, _, sides["transformers bf16"] = bs.Reference(model_dir, torch.bfloat16, pad).score(prompts, 16)
    for name, res in sides.items():
        c = bs.compare(res, fp32)
        print(f"{name:<20} vs fp32: max {c['max_abs_diff']:.3f}  mean {c['mean_abs_diff']:.4f}  "
              f"top-1 within 0.05: {c['top1_agree']:.3f}  ({c['tokens']} tokens)")
    for name in ("eager bf16", "compiled bf16"):
        c = bs.compare(sides[name], sides["transformers bf16"])
        print(f"{name:<20} vs transformers bf16: max {c['max_abs_diff']:.3f}  mean {c['mean_abs_diff']:.4f}")


if __name__ == "__main__":
    main()
