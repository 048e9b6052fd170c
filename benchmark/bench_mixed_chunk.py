"""Mixed chunks (--enable-mixed-chunk) against alternating prefill and decode steps, in one
run, on one in-process scheduler compiled as served (step_breakdown.make_scheduler).

    .venv/bin/python benchmark/bench_mixed_chunk.py [--rate 4.5] [--num-prompts 48]
        [--input-len 128] [--output-len 128] [--rounds 3] [--dtype auto]

Requests arrive on the wall clock (Poisson at --rate; the same arrival times, prompts and
lengths every round), and the scheduler is stepped as its event loop would. The two modes
take turns on the same compiled scheduler (the flag is read per step), --rounds times each.
Per mode, medians over rounds of: output tokens/s, inter-token latency (median, p99 and
their ratio) and time to first token (median, p90). Then the per-step breakdown of every
batch kind (StepStats: forward / sampling / grammar / scheduler ms per step, and how many
steps), so the next person sees where a mixed step's time goes.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

import machine_floor
import step_breakdown
from bench_offline import chat_prompts


def workload(tok, n: int, rate: float, input_len: int, output_len: int, seed: int = 0):
    """[(arrival second, prompt ids, new tokens)]: chat prompts padded with words to about
    --input-len tokens; outputs uniform in [output_len / 2, output_len]."""
    from srt.tokenizer_utils import apply_chat_template

    rnd = random.Random(seed)
    t, out = 0.0, []
    for i, messages in enumerate(chat_prompts(n)):
        ids = list(apply_chat_template(tok, messages))
        filler = tok(" " + " ".join(rnd.choice(["sea", "stone", "light", "river", "paper", "bird"])
                                    for _ in range(max(input_len - len(ids), 0))))["input_ids"]
        out.append((t, list(filler[:max(input_len - len(ids), 0)]) + list(ids),
                    rnd.randint(output_len // 2, output_len)))
        t += rnd.expovariate(rate)
    return out


def run_round(sched, reqs, mixed: bool, tag: str) -> dict:
    """Step the scheduler until every request is done; per-token arrival times."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    sched.mixed_chunk = mixed
    sched.step_stats.reset()
    pending = list(enumerate(reqs))
    sent, times = {}, {}
    start = time.perf_counter()
    while pending or sched.has_work():
        now = time.perf_counter() - start
        due = [(i, r) for i, r in pending if r[0] <= now]
        if due:
            pending = pending[len(due):]
            msgs = []
            for i, (at, ids, n) in due:
                rid = f"{tag}-{i}"
                sent[rid] = start + at
                msgs.append(TokenizedGenerateReq(rid, tuple(ids), SamplingParams.from_dict(
                    {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}), stream=True))
            sched.process_input_requests(msgs)
        if not sched.has_work():
            time.sleep(max(min(pending[0][1][0] - now, 0.01), 0))
            continue
        for out in sched.step():
            t = time.perf_counter()
            for rid, new in zip(out.rids, out.new_token_ids):
                if new:
                    times.setdefault(rid, []).extend([t] * len(new))
    elapsed = time.perf_counter() - start
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:]) if b > a]
    ttft = [ts[0] - sent[rid] for rid, ts in times.items()]
    return {"tok_s": sum(len(ts) for ts in times.values()) / elapsed,
            "itl_median": 1e3 * float(np.median(itl)), "itl_p99": 1e3 * float(np.percentile(itl, 99)),
            "ttft_median": 1e3 * float(np.median(ttft)), "ttft_p90": 1e3 * float(np.percentile(ttft, 90)),
            "steps": {m: (t.steps, t.per_step_ms()) for m, t in sched.step_stats.by_mode.items()}}


def main():
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=4.5, help="requests per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--server-args", default="", help="extra ServerArgs as k=v,k=v (e.g. chunked_prefill_size=128)")
    args = p.parse_args()
    from srt.model_executor.model_loader import resolve_model_path
    from srt.model_executor.model_runner import cpu_has_native_bf16

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    extra = dict(kv.split("=") for kv in args.server_args.split(",") if kv)
    extra = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in extra.items()}
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={dtype} "
          f"threads={torch.get_num_threads()} {extra}")
    model_dir = resolve_model_path(None)
    sched = step_breakdown.make_scheduler(model_dir, dtype, args.max_running, **extra)
    reqs = workload(sched.tokenizer, args.num_prompts, args.rate, args.input_len, args.output_len)
    run_round(sched, reqs[:4], False, "warm")  # first prefills and decodes off the clock
    results = {False: [], True: []}
    for r in range(args.rounds):
        for mixed in (False, True):
            results[mixed].append(run_round(sched, reqs, mixed, f"r{r}{int(mixed)}"))
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "steps"}
           for m, rs in results.items()}
    print(f"\n{args.num_prompts} requests at {args.rate}/s, ~{args.input_len} prompt tokens, "
          f"{args.output_len // 2}-{args.output_len} new; medians of {args.rounds} rounds")
    for m, name in ((False, "alternating"), (True, "mixed")):
        x = med[m]
        print(f"{name:12s} {x['tok_s']:6.1f} tok/s  ITL median {x['itl_median']:6.1f} ms p99 "
              f"{x['itl_p99']:6.1f} ms (p99/median {x['itl_p99'] / x['itl_median']:.2f}x)  TTFT median "
              f"{x['ttft_median']:6.1f} ms p90 {x['ttft_p90']:6.1f} ms")
    print(f"mixed vs alternating: tok/s {med[True]['tok_s'] / med[False]['tok_s']:.2f}x, ITL p99 "
          f"{med[True]['itl_p99'] / med[False]['itl_p99']:.2f}x, TTFT p90 "
          f"{med[True]['ttft_p90'] / med[False]['ttft_p90']:.2f}x")
    print("\nper-step breakdown, last round (ms per step: forward / sampling / grammar / scheduler)")
    for m, name in ((False, "alternating"), (True, "mixed")):
        for mode, (steps, ms) in sorted(results[m][-1]["steps"].items()):
            print(f"{name:12s} {mode:7s} {steps:5d} steps  " + "  ".join(f"{k} {v:6.1f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()
