"""Constrained vs unconstrained decode throughput, same prompts, same run.

    .venv/bin/python benchmark/bench_constrained.py [--concurrency 32] [--max-new-tokens 64]
        [--repeats 3] [--dtype auto] [--skip-bitmask]

The real scheduler (SmolLM2, in process, no HTTP) runs --concurrency requests at once,
greedily, three ways: unconstrained, and with one JSON schema through xgrammar and through
llguidance. Every request makes exactly --max-new-tokens tokens (ignore_eos; the schema is
an open-ended list, so the grammar never ends first), so all three runs decode the same
batch sizes. Grammars are compiled (and cached) by a warm-up run; the timed runs measure
decoding only. The three configurations alternate within each repeat; medians are printed.

Printed: decode tokens/s, the ratio to unconstrained, and the mean per-step time spent
filling the bitmask (grammar libraries) and applying it to the logits. Then the CPU
bitmask micro-benchmark (benchmark/bench_bitmask.py): ours vs xgrammar's apply.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "required": ["facts"], "properties": {"facts": {
    "type": "array", "minItems": 60, "items": {
        "type": "object", "required": ["fact", "year", "verified"], "properties": {
            "fact": {"type": "string"}, "year": {"type": "integer"}, "verified": {"type": "boolean"}}}}}}
TOPICS = ["the ocean", "compilers", "bread", "black holes", "chess", "bees", "Rome", "jazz"]


def make_scheduler(backend: str, concurrency: int, dtype: str):
    from transformers import AutoTokenizer

    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.managers.scheduler import Scheduler
    from srt.model_config import ModelConfig
    from srt.model_loader import resolve_model_path
    from srt.server_args import ServerArgs

    path = resolve_model_path(None)
    # Compiled before timing (the served default at TP=1 compiles in the background,
    # which would time the eager step and a busy compile thread instead).
    args = ServerArgs(model_path=path, random_seed=0, grammar_backend=backend, dtype=dtype,
                      max_running_requests=concurrency, max_total_tokens=concurrency * 256,
                      wait_for_torch_compile=True)
    tok = AutoTokenizer.from_pretrained(path)
    return Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(path, None), tok), tok


def requests(tok, n: int, max_new: int, constrained: bool, tag: str):
    from sampling.sampling_params import SamplingParams
    from srt.managers.io_struct import TokenizedGenerateReq

    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    if constrained:
        params["json_schema"] = SCHEMA
    out = []
    for i in range(n):
        msg = [{"role": "user", "content": f"List facts about {TOPICS[i % len(TOPICS)]} as JSON."}]
        ids = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(TokenizedGenerateReq(f"{tag}-{i}", tuple(ids), SamplingParams.from_dict(params)))
    return out


def run_once(sched, reqs) -> dict:
    """Decode tok/s (steps after every request is admitted) and per-step mask times."""
    sched.process_input_requests(reqs)
    while sched.grammar_manager.grammar_queue or sched.waiting:  # compile + prefill
        sched.step()
    sched.mask_fill_seconds = sched.mask_apply_seconds = 0.0
    sched.mask_steps = 0
    tokens, start = 0, time.perf_counter()
    while sched.running:
        tokens += len(sched.running)
        sched.step()
    elapsed = time.perf_counter() - start
    while sched.has_work():
        sched.step()
    steps = max(sched.mask_steps, 1)
    return {"tok_s": tokens / elapsed, "fill_ms": 1e3 * sched.mask_fill_seconds / steps,
            "apply_ms": 1e3 * sched.mask_apply_seconds / steps, "step_ms": 1e3 * elapsed / max(tokens / len(reqs), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-bitmask", action="store_true")
    a = ap.parse_args()
    import torch

    torch.set_grad_enabled(False)
    # One scheduler each, so all three see the same KV-pool history (slot order matters).
    plain, tok = make_scheduler("xgrammar", a.concurrency, a.dtype)
    xgr, _ = make_scheduler("xgrammar", a.concurrency, a.dtype)
    llg, _ = make_scheduler("llguidance", a.concurrency, a.dtype)
    configs = {"unconstrained": (plain, False), "json xgrammar": (xgr, True), "json llguidance": (llg, True)}
    for name, (sched, constrained) in configs.items():  # warm-up: compile, caches, allocator
        run_once(sched, requests(tok, a.concurrency, 8, constrained, f"warm-{name}"))
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(a.repeats):
        for name, (sched, constrained) in configs.items():
            results[name].append(run_once(sched, requests(tok, a.concurrency, a.max_new_tokens, constrained, f"{r}-{name}")))
    base = statistics.median(x["tok_s"] for x in results["unconstrained"])
    print(f"\n{a.concurrency} concurrent requests x {a.max_new_tokens} tokens, greedy, "
          f"median of {a.repeats} (schema: {json.dumps(SCHEMA)})")
    print(f"{'run':<18}{'decode tok/s':>14}{'ratio':>8}{'step ms':>10}{'fill ms/step':>14}{'apply ms/step':>15}")
    for name, runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(f"{name:<18}{med['tok_s']:>14.1f}{med['tok_s'] / base:>8.3f}{med['step_ms']:>10.1f}"
              f"{med['fill_ms']:>14.3f}{med['apply_ms']:>15.3f}")
    if not a.skip_bitmask:
        from bench_bitmask import print_rows, run_bitmask_bench

        print("\nCPU bitmask apply, fp32 logits: ours vs xgrammar.apply_token_bitmask_inplace")
        print_rows(run_bitmask_bench(7))


if __name__ == "__main__":
    main()
