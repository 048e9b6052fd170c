"""Prefills of a few new tokens through the compiled decode graphs (srt/model_executor/
extend_as_decode.py) against the compiled prefill, alternating on one in-process scheduler.

    LD_PRELOAD=<mimalloc> .venv/bin/python benchmark/bench_extend_as_decode.py
        [--new 1,4,8,16] [--rounds 5] [--per-round 8] [--model-path PATH] [--dtype auto]

Each request is a cached prefix (a chat prompt, prefilled once at the start) followed by
``n`` fresh random tokens, so its prefill computes exactly ``n`` tokens (``n`` = 1: the
whole prompt sent again, as each of ``n`` > 1 choices after the first is). One request per
step, timed around ``Scheduler.step``. "prefill" swaps the conversion out (the model runner
then prefills as before); the order alternates every round. Prints the median step per
``n`` both ways, their ratio (decode rows over prefill: lower is better) and how many
rounds the decode rows won. Default model: the shipped GGUF (served from its codes).
The served processes preload mimalloc (cpu_allocator.py); run with the same ``LD_PRELOAD``.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine_floor  # noqa: E402
from ab_rounds import PrefillTimer, ab_rounds, report  # noqa: E402
import step_breakdown  # noqa: E402
from bench_offline import chat_prompts  # noqa: E402


def main() -> None:
    import srt.model_executor.model_runner as model_runner
    from srt.model_executor.model_loader import embedded_gguf_path, resolve_model_path
    from srt.tokenizer_utils import apply_chat_template, get_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", default="1,4,8,16", help="fresh tokens per prefill")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--model-path", default=None, help="default: the shipped GGUF")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    news = [int(x) for x in args.new.split(",")]
    model_dir = resolve_model_path(args.model_path or embedded_gguf_path())
    sched = step_breakdown.make_scheduler(model_dir, args.dtype, 16)
    decode = sched.runner.compiled_decode
    if decode is None or not decode.ready or sched.runner.compiled_switch.prefill is None:
        raise SystemExit("the compiled decode and prefill are not both in use here")
    if max(news) > decode.max_bs:
        raise SystemExit(f"--new up to {decode.max_bs} (the decode graphs' rows)")
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={sched.runner.dtype} "
          f"threads={torch.get_num_threads()} malloc={os.path.basename(os.environ.get('LD_PRELOAD', 'glibc'))} "
          f"model={os.path.basename(model_dir)}")
    prefix = list(apply_chat_template(get_tokenizer(model_dir), chat_prompts(1)[0]))
    rnd, prefill_ms = random.Random(0), PrefillTimer(sched)

    def step_ms(n: int) -> float:
        # n == 1: the cached prompt again (its last token is computed anew); else n fresh
        # tokens after it (the whole prompt is cached, so exactly those n are computed).
        return prefill_ms(prefix if n == 1 else prefix + [rnd.randrange(100, 40000) for _ in range(n)])

    convert = model_runner.extend_as_decode
    step_ms(1)  # the prefix into the cache
    times = ab_rounds({"decode rows": lambda: setattr(model_runner, "extend_as_decode", convert),
                       "prefill": lambda: setattr(model_runner, "extend_as_decode", lambda fb, max_rows: None)},
                      news, step_ms, args.rounds, args.per_round)
    report(times, "extend {n} new tokens")

if __name__ == "__main__":
    main()
