"""Constrained vs unconstrained decode throughput, same prompts, same run.

    .venv/bin/python benchmark/bench_constrained.py [--concurrency 32,1] [--max-new-tokens 64]
        [--repeats 3] [--dtype auto] [--eager] [--profile] [--skip-bitmask]

One real scheduler (SmolLM2, in process, no HTTP; its decode step compiled before timing
unless --eager) runs each --concurrency level of requests at once, greedily: unconstrained,
and with one JSON schema through xgrammar and through llguidance, each without and with
grammar fast-forward (the scheduler's grammar manager and fast-forward switch change between
runs, so all configurations share one compiled step and one KV pool).
Every request makes exactly --max-new-tokens tokens (ignore_eos; the schema is an
open-ended list, so the grammar never ends first), so every run decodes the same batch
sizes. Grammars are compiled (and cached) by a warm-up run; the timed runs measure decoding
only. The configurations alternate within each repeat; medians are printed.

Printed: output tokens/s during decode (forced tokens included: they are output the user
gets), the ratio to unconstrained, the per-step phase breakdown (forward / sampling /
grammar / scheduler, from the scheduler's own counters), the mask fill time as waited for
on the critical path and as worked on the overlap thread, the time to apply the mask, and
the share of output tokens fast-forward appended. --profile adds a cProfile of one
constrained and one unconstrained run: the functions whose time differs most.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

SCHEMA = {"type": "object", "required": ["facts"], "properties": {"facts": {
    "type": "array", "minItems": 60, "items": {
        "type": "object", "required": ["fact", "year", "verified"], "properties": {
            "fact": {"type": "string"}, "year": {"type": "integer"}, "verified": {"type": "boolean"}}}}}}
TOPICS = ["the ocean", "compilers", "bread", "black holes", "chess", "bees", "Rome", "jazz"]


def make_scheduler(concurrency: int, dtype: str, eager: bool, **server_kwargs):
    from transformers import AutoTokenizer

    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.scheduler.scheduler import Scheduler
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import resolve_model_path
    from srt.server_args import ServerArgs

    path = resolve_model_path(None)
    # Compiled before timing (the served default at TP=1 compiles in the background,
    # which would time the eager step and a busy compile thread instead).
    # max_running_requests: 64 (the CPU server default is 16), so the compiled step has room for the
    # rows fast-forward adds (it never pushes a step past the compiled batch size).
    args = ServerArgs(model_path=path, random_seed=0, grammar_backend="xgrammar", dtype=dtype,
                      max_running_requests=max(64, concurrency), max_total_tokens=concurrency * 256,
                      wait_for_torch_compile=not eager, disable_torch_compile=eager, **server_kwargs)
    tok = AutoTokenizer.from_pretrained(path)
    return Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(path, None), tok), tok


def grammar_manager(sched, tok, backend: str):
    """A grammar manager for ``backend`` over the scheduler's own settings."""
    import dataclasses

    from constrained.grammar_manager import GrammarManager
    from constrained.registry import create_grammar_backend

    args = dataclasses.replace(sched.server_args, grammar_backend=backend)
    cfg = sched.model_config
    return GrammarManager(create_grammar_backend(args, tok, sched.vocab_size, tuple(cfg.eos_token_ids)),
                          sched.tp, **sched.grammar_manager_kwargs())


def requests(tok, n: int, max_new: int, constrained: bool, tag: str):
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    if constrained:
        params["json_schema"] = SCHEMA
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": f"List facts about {TOPICS[i % len(TOPICS)]} as JSON."}]
        ids = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(TokenizedGenerateReq(f"{tag}-{i}", tuple(ids), SamplingParams.from_dict(params)))
    return out


def run_once(sched, reqs, profiler=None) -> dict:
    """Output tok/s during decode (steps after every request is admitted), phases and mask
    times per step, and the share of the output fast-forward appended."""
    sched.process_input_requests(reqs)
    while sched.grammar_manager.grammar_queue or sched.waiting:  # compile + prefill
        sched.step()
    stats = sched.step_stats
    stats.mask_fill_seconds = stats.mask_fill_work_seconds = stats.mask_apply_seconds = 0.0
    stats.mask_steps = stats.mask_checked_first_steps = 0
    sched.step_stats.reset()
    live = list(sched.running)
    before = sum(len(r.output_ids) for r in live)
    forced_before = sched.step_stats.fast_forward_tokens
    steps, start = 0, time.perf_counter()
    if profiler is not None:
        profiler.enable()
    while sched.running:
        steps += 1
        sched.step()
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in live) - before
    phases = sched.step_stats.mode("DECODE").per_step_ms()
    while sched.has_work():
        sched.step()
    masked = max(sched.step_stats.mask_steps, 1)
    return {"tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed / max(steps, 1),
            "fill_wait_ms": 1e3 * sched.step_stats.mask_fill_seconds / masked,
            "fill_work_ms": 1e3 * sched.step_stats.mask_fill_work_seconds / masked,
            "apply_ms": 1e3 * sched.step_stats.mask_apply_seconds / masked,
            "forced_pct": 100 * (sched.step_stats.fast_forward_tokens - forced_before) / max(tokens, 1),
            "unmasked_pct": 100 * sched.step_stats.mask_checked_first_steps / max(steps, 1),
            **{f"{k}_ms": v for k, v in phases.items()}}


def profile_diff(sched, tok, managers, a) -> None:
    """cProfile one run of each configuration; print the functions whose cumulative
    per-step time grew most under a grammar (the overhead, function by function)."""
    tables = {}
    for name, (manager, constrained, fast_forward) in managers.items():
        sched.grammar_manager, sched.fast_forward = manager, fast_forward
        prof = cProfile.Profile()
        run_once(sched, requests(tok, a.concurrency, a.max_new_tokens, constrained, f"prof-{name}"), prof)
        stats = pstats.Stats(prof, stream=io.StringIO())
        tables[name] = {f"{fn[0].split('/')[-1]}:{fn[1]}({fn[2]})": (row[2], row[3])
                        for fn, row in stats.stats.items()}
    base = tables.pop("unconstrained")
    steps = a.max_new_tokens  # ~ decode steps per run (fewer with fast-forward)
    for name, table in tables.items():
        print(f"\ncProfile, {name} minus unconstrained: ms per step (tottime, cumtime), top 15 by tottime")
        diffs = sorted(((t[0] - base.get(k, (0, 0))[0], t[1] - base.get(k, (0, 0))[1], k)
                        for k, t in table.items()), reverse=True)[:15]
        for tot, cum, k in diffs:
            print(f"  {1e3 * tot / steps:8.3f} {1e3 * cum / steps:8.3f}  {k}")


def main() -> None:
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="32,1", help="comma-separated levels")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--eager", action="store_true", help="no compiled decode step (faster start)")
    ap.add_argument("--profile", action="store_true", help="add a cProfile diff per configuration")
    ap.add_argument("--skip-bitmask", action="store_true")
    a = ap.parse_args()
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from machine_floor import cpu_flags, cpu_model

    torch.set_grad_enabled(False)
    levels = [int(c) for c in a.concurrency.split(",")]
    sched, tok = make_scheduler(max(levels), a.dtype, a.eager)
    llg = grammar_manager(sched, tok, "llguidance")
    # name -> (grammar manager, constrained, fast-forward)
    managers = {"unconstrained": (sched.grammar_manager, False, False),
                "json xgrammar": (sched.grammar_manager, True, False),
                "json llguidance": (llg, True, False),
                "json xgrammar +ff": (sched.grammar_manager, True, True),
                "json llguidance +ff": (llg, True, True)}
    print(f"\n{cpu_model()} {cpu_flags()}; dtype {sched.runner.dtype}; decode step "
          f"{'eager' if a.eager else 'compiled'}; schema: {json.dumps(SCHEMA)}")
    cols = ["tok_s", "step_ms", "forward_ms", "sampling_ms", "grammar_ms", "scheduler_ms",
            "fill_wait_ms", "fill_work_ms", "apply_ms", "forced_pct", "unmasked_pct"]
    for level in levels:
        a.concurrency = level
        for name, (manager, constrained, ff) in managers.items():  # warm-up: compile, caches
            sched.grammar_manager, sched.fast_forward = manager, ff
            run_once(sched, requests(tok, level, 8, constrained, f"warm{level}-{name}"))
        results: dict[str, list[dict]] = {name: [] for name in managers}
        for r in range(a.repeats):
            for name, (manager, constrained, ff) in managers.items():
                sched.grammar_manager, sched.fast_forward = manager, ff
                results[name].append(run_once(sched, requests(tok, level, a.max_new_tokens,
                                                              constrained, f"{r}-{level}-{name}")))
        base = statistics.median(x["tok_s"] for x in results["unconstrained"])
        print(f"\n{level} concurrent requests x {a.max_new_tokens} tokens, greedy, median of {a.repeats}")
        print(f"{'run':<21}{'ratio':>7}" + "".join(f"{c:>13}" for c in cols))
        for name, runs in results.items():
            med = {k: statistics.median(x[k] for x in runs) for k in cols}
            print(f"{name:<21}{med['tok_s'] / base:>7.3f}" + "".join(f"{med[c]:>13.3f}" for c in cols))
    print("(tok_s: output tokens per second, forced ones included; grammar_ms: fill waited for +"
          " accepting tokens + fast-forward; apply_ms is inside sampling_ms; fill_work_ms ran"
          " on the overlap thread during the forward, or in line; unmasked_pct: steps whose greedy"
          " ids every grammar allowed, so no mask was filled, sampling/check_first.py)")
    if a.profile:
        a.concurrency = levels[0]
        profile_diff(sched, tok, managers, a)
    if not a.skip_bitmask:
        from bench_bitmask import print_rows, run_bitmask_bench

        print("\nCPU bitmask apply, fp32 logits: ours vs xgrammar.apply_token_bitmask_inplace")
        print_rows(run_bitmask_bench(7))


if __name__ == "__main__":
    main()
