"""Hybrid Gated DeltaNet serving (issue 61) on a Qwen3.5-shaped random model of ~130M
parameters (hybrid_model.py), in process on the real scheduler, eager (as hybrids are served).

    .venv/bin/python benchmark/bench_hybrid.py [--rounds 3] [--dtype auto] [--cases prefix,spec,decode]
        [--requests 32] [--system-tokens 1500] [--concurrency 4] [--new-tokens 16]

- prefix: ``--requests`` requests that share a ``--system-tokens`` system prompt, each with its
  own question, greedy, ``--concurrency`` at a time (a closed loop: one finishes, the next is
  sent); radix cache on (its state checkpoints) against off, rounds alternating, the cache
  flushed before each on round. tokens/s = (prompt + output tokens) / wall time. Outputs on
  and off must be identical (a MISMATCH line otherwise). Summary line, exactly:
      hybrid prefix cache: ratio <x>x
- spec: bench_spec's rewrite workload at batch 1, NGRAM speculation on against off on one
  scheduler (bench_spec.run_round), greedy outputs identical. Summary line, exactly:
      hybrid spec rewrite bs=1 speedup <x>x
- decode: the decode step at batch 1 and 16 against its floor, the bytes a step must move at
  the machine's measured read bandwidth: the weights once, each row's recurrent state read and
  written, its KV read; with the eager forward split by module (GDN projections, the GDN's
  conv / delta rule / gated norm, attention, the other linears, the rest).

Targets (the issue): prefix cache ratio >= 3x, spec rewrite bs=1 speedup >= 1.5x. Random
weights: the drafter's acceptance on them says nothing about trained weights.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from contextlib import contextmanager

import torch

import bench_spec
import machine_floor
import step_breakdown
from hybrid_model import hybrid_model_dir


def prefix_workload(tok, requests: int, system_tokens: int) -> list[tuple[int, ...]]:
    sentences, text = [], ""
    while len(tok(text)["input_ids"]) < system_tokens:
        i = len(sentences)
        sentences.append(f"Rule {i}: when asked about item {i}, answer with its shelf, {i % 13}, and colour {i % 7}.")
        text = " ".join(sentences)
    return [tuple(tok(f"{text}\nQuestion {q}: where is item {q * 7 % 97}?")["input_ids"]) for q in range(requests)]


def closed_loop(sched, prompts, new_tokens: int, concurrency: int, tag: str) -> dict:
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    queue = deque(enumerate(prompts))
    outs: dict[int, list[int]] = {}
    cached, live = 0, 0
    sched.step_stats.reset()
    start = time.perf_counter()
    while queue or sched.has_work():
        msgs = []
        while queue and live < concurrency:
            i, ids = queue.popleft()
            msgs.append(TokenizedGenerateReq(f"{tag}-{i}", ids, params))
            live += 1
        sched.process_input_requests(msgs)
        for out in sched.step():
            for j, rid in enumerate(out.rids):
                i = int(rid.rsplit("-", 1)[1])
                outs.setdefault(i, []).extend(out.new_token_ids[j])
                if out.finished_reasons[j] is not None:
                    live -= 1
                    cached += out.cached_tokens[j]
    elapsed = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts) + sum(len(o) for o in outs.values())
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "outputs": [outs[i] for i in range(len(prompts))],
            "cached": cached, "phases": {m: (t.steps, t.per_step_ms()) for m, t in sched.step_stats.by_mode.items()}}


def bench_prefix(model_dir, dtype, args) -> None:
    kv = (args.system_tokens + 200) * (args.concurrency + 2)  # the running prompts and the cached one
    on = step_breakdown.make_scheduler(model_dir, dtype, args.concurrency, max_total_tokens=kv)
    off = step_breakdown.make_scheduler(model_dir, dtype, args.concurrency, max_total_tokens=kv,
                                        disable_radix_cache=True)
    prompts = prefix_workload(on.tokenizer, args.requests, args.system_tokens)
    print(f"prefix: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.new_tokens} new tokens each, concurrency {args.concurrency}; state pool "
          f"{on.runner.state_pool.num_slots} slots x {on.runner.state_bytes_per_slot / 2**20:.2f} MiB", flush=True)
    res = {True: [], False: []}
    ref = None
    for r in range(args.rounds):
        for cache in (False, True):
            if cache:
                on.kv.flush_cache()
            got = closed_loop(on if cache else off, prompts, args.new_tokens, args.concurrency, f"p{r}{int(cache)}")
            res[cache].append(got)
            ref = ref or got["outputs"]
            for i, (a, b) in enumerate(zip(ref, got["outputs"])):
                if a != b:
                    print(f"MISMATCH prefix cache={'on' if cache else 'off'} round {r} request {i}", flush=True)
            print(f"  round {r} cache {'on ' if cache else 'off'}: {got['seconds']:6.2f} s {got['tok_s']:8.1f} tok/s "
                  f"cached tokens {got['cached']}", flush=True)
    tok_s = {c: statistics.median(x["tok_s"] for x in rs) for c, rs in res.items()}
    for c in (False, True):
        phases = "  ".join(f"{m} {n} steps {', '.join(f'{k} {v:.1f}' for k, v in ms.items())} ms/step"
                           for m, (n, ms) in res[c][-1]["phases"].items())
        print(f"  breakdown cache {'on ' if c else 'off'}: {phases}")
    print(f"prefix: off {tok_s[False]:.1f} tok/s  on {tok_s[True]:.1f} tok/s (medians of {args.rounds})")
    print(f"hybrid prefix cache: ratio {tok_s[True] / tok_s[False]:.2f}x", flush=True)


def bench_spec_rewrite(model_dir, dtype, args) -> None:
    sched = step_breakdown.make_scheduler(model_dir, dtype, 4, speculative_algorithm="NGRAM")
    spec_config = sched.spec_config
    reqs = bench_spec.case_requests(sched.tokenizer, "rewrite", 1)
    ref = bench_spec.run_round(sched, reqs, None, "sw0")
    bench_spec.check_same(ref, bench_spec.run_round(sched, reqs, spec_config, "sw1"), "rewrite warm-up")
    res = {False: [], True: []}
    for r in range(args.rounds):
        for on in (False, True):
            res[on].append(bench_spec.run_round(sched, reqs, spec_config if on else None, f"s{r}{int(on)}"))
            bench_spec.check_same(ref, res[on][-1], f"rewrite round {r}")
    tok_s = {on: statistics.median(x["tok_s"] for x in rs) for on, rs in res.items()}
    c = res[True][-1]["counters"]
    print(f"spec rewrite bs=1: off {tok_s[False]:.1f} tok/s  on {tok_s[True]:.1f} tok/s  ({res[True][0]['total']} "
          f"output tokens; verify steps {c['spec_verify_steps']} drafted {c['spec_drafted_tokens']} accepted "
          f"{c['spec_accepted_tokens']}; state rollbacks {sched.kv.state_pool.rollbacks})")
    print(f"hybrid spec rewrite bs=1 speedup {tok_s[True] / tok_s[False]:.2f}x", flush=True)


@contextmanager
def module_split(model, totals: dict[str, float]):
    """Eager forward time by module kind (hooks; nested GDN projections counted apart; the GDN
    layers' whole time through the function the decoder layer calls)."""
    import srt.models.hybrid_decoder as hybrid
    from srt.layers.attention import Attention
    from srt.layers.linear import _TPLinear
    from srt.layers.vocab_parallel_embedding import ParallelLMHead

    run = hybrid.run_linear_attention

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return run(*a, **kw)
        finally:
            totals["gdn"] = totals.get("gdn", 0.0) + time.perf_counter() - t

    hybrid.run_linear_attention = timed
    handles, starts = [], {}
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            cat = "attention"
        elif isinstance(m, (_TPLinear, ParallelLMHead)):
            cat = "gdn_linear" if ".linear_attn." in name else "linear"
        else:
            continue
        handles.append(m.register_forward_pre_hook(lambda mod, a: starts.__setitem__(id(mod), time.perf_counter())))
        handles.append(m.register_forward_hook(
            lambda mod, a, o, cat=cat: totals.__setitem__(cat, totals.get(cat, 0.0) + time.perf_counter() - starts[id(mod)])))
    try:
        yield
    finally:
        hybrid.run_linear_attention = run
        for h in handles:
            h.remove()


def bench_decode(model_dir, dtype, args) -> None:
    sched = step_breakdown.make_scheduler(model_dir, dtype, 16)
    runner, model = sched.runner, sched.runner.model
    bw = machine_floor.read_bandwidth_gbs()
    floors = machine_floor.model_floors(model, runner.dtype, bw, machine_floor.matmul_peak_gflops(runner.dtype))
    tok = sched.tokenizer
    prompt = tuple(tok("Summarise the rules of chess in a few sentences.")["input_ids"])
    kv_per_token = runner._kv_bytes_per_token() - runner.logprob_bytes_per_token()
    for bs in (1, 16):
        prompts = [prompt + (100 + i,) for i in range(bs)]
        step_breakdown._decode(sched, prompts, 8, f"w{bs}")
        steps = step_breakdown._decode(sched, prompts, args.new_tokens * 2, f"d{bs}")
        ms = 1e3 * statistics.median(steps)
        state = 2 * runner.state_bytes_per_slot * bs  # read and written
        kv = kv_per_token * (len(prompt) + args.new_tokens) * bs
        floor = 1e3 * (floors["weight_bytes"] + state + kv) / (bw * 1e9)
        compute = floors["compute_ms_per_row"] * bs
        totals: dict[str, float] = {}
        with module_split(model, totals):
            eager = step_breakdown._decode(sched, prompts, 8, f"e{bs}", on_decode_start=totals.clear)
        n = len(eager)
        forward = sched.step_stats.mode("DECODE").seconds["forward"] / n
        gdn_core = totals.get("gdn", 0) - totals.get("gdn_linear", 0)
        split = {"GDN projections": totals.get("gdn_linear", 0), "GDN conv+rule+norm": gdn_core,
                 "attention": totals.get("attention", 0), "other linears": totals.get("linear", 0)}
        split = {k: 1e3 * v / n for k, v in split.items()}
        split["rest"] = 1e3 * forward - sum(split.values())
        print(f"hybrid decode bs={bs} {ms:.2f} ms per step, floor {max(floor, compute):.2f} ms "
              f"(weights {floors['weight_bytes'] / 2**20:.0f} MiB + states {state / 2**20:.1f} MiB + KV "
              f"{kv / 2**20:.1f} MiB at {bw:.1f} GB/s; compute {compute:.2f} ms), "
              f"{ms / max(floor, compute):.2f}x the floor")
        print("  eager forward split (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()), flush=True)


def main():
    from srt.model_executor.cpu_allocator import reexec_with_allocator
    from srt.model_executor.model_runner import cpu_has_native_bf16

    reexec_with_allocator()  # the allocator the server's ranks use
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--cases", default="prefix,spec,decode")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    model_dir = hybrid_model_dir()
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} dtype={dtype} "
          f"threads={torch.get_num_threads()} model={model_dir}", flush=True)
    cases = {"prefix": bench_prefix, "spec": bench_spec_rewrite, "decode": bench_decode}
    for case in args.cases.split(","):
        cases[case](model_dir, dtype, args)


if __name__ == "__main__":
    main()
