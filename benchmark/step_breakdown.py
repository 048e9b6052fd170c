"""Where a decode step goes, measured on the real scheduler in process (no HTTP, no IPC).

For each concurrency: ``c`` greedy requests decode together; the scheduler's own phase
counters (``Scheduler.step_stats``: forward, sampling, grammar, scheduler) give the split
of the step as served (compiled where it is). The forward's inner split (attention /
linear layers / everything else) comes from a second pass with the eager forward and
timing hooks on the modules: Inductor fuses the compiled graph, so it has no module
boundaries to time.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch


def make_scheduler(model_dir: str, dtype: str, max_running: int, **server_kwargs):
    from transformers import AutoTokenizer

    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.scheduler.scheduler import Scheduler
    from srt.model_executor.model_config import ModelConfig
    from srt.server_args import ServerArgs

    server_kwargs.setdefault("max_total_tokens", max_running * 512)
    args = ServerArgs(model_path=model_dir, random_seed=0, dtype=dtype, max_running_requests=max_running,
                      wait_for_torch_compile=True, **server_kwargs)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return Scheduler(args, RankInfo(), SINGLE_RANK, ModelConfig.from_path(model_dir, None), tok)


def _decode(sched, prompts_ids: list[list[int]], new_tokens: int, tag: str,
            on_decode_start=lambda: None) -> list[float]:
    """Run the requests to the end; the wall time of each pure decode step."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
    sched.process_input_requests([TokenizedGenerateReq(f"{tag}-{i}", tuple(ids), params)
                                  for i, ids in enumerate(prompts_ids)])
    while sched.waiting:  # prefill everything first
        sched.step()
    sched.step_stats.reset()
    on_decode_start()
    times = []
    while sched.running:
        t = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t)
    return times


@contextmanager
def _module_timers(model: torch.nn.Module, totals: dict[str, float]):
    from srt.layers.attention import Attention
    from srt.layers.linear import _TPLinear
    from srt.layers.vocab_parallel_embedding import ParallelLMHead

    handles, starts = [], {}

    def category(m):
        if isinstance(m, Attention):
            return "attention"
        if isinstance(m, (_TPLinear, ParallelLMHead)):
            return "linear"
        return None

    for m in model.modules():
        cat = category(m)
        if cat is None:
            continue
        handles.append(m.register_forward_pre_hook(lambda mod, a: starts.__setitem__(id(mod), time.perf_counter())))
        handles.append(m.register_forward_hook(
            lambda mod, a, out, cat=cat: totals.__setitem__(cat, totals[cat] + time.perf_counter() - starts[id(mod)])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def breakdown(sched, prompts_ids, concurrency: int, new_tokens: int, eager_split: bool = True) -> dict:
    """One concurrency level: the served step and its phases, then (``eager_split``) the
    eager forward split."""
    batch = [prompts_ids[i % len(prompts_ids)] for i in range(concurrency)]
    # A whole untimed pass first: with 4 warm-up tokens the first level measured read 1.2-1.3x
    # slow (first touches of the KV pool's pages, the machine settling; docs/speed-history.md).
    _decode(sched, batch, new_tokens, f"warm{concurrency}")
    steps = _decode(sched, batch, new_tokens, f"c{concurrency}")
    phases = sched.step_stats.mode("DECODE").per_step_ms()
    row = {"concurrency": concurrency, "step_ms": 1e3 * statistics.median(steps), "phases_ms": phases}
    if not eager_split:
        return row
    runner = sched.runner
    compiled, runner.compiled_switch.decode = runner.compiled_switch.decode, None
    totals = {"attention": 0.0, "linear": 0.0}
    try:
        with _module_timers(runner.model, totals):
            eager_steps = _decode(sched, batch, min(new_tokens, 16), f"e{concurrency}",
                                  on_decode_start=lambda: totals.update(attention=0.0, linear=0.0))
    finally:
        runner.compiled_switch.decode = compiled
    n = len(eager_steps)
    forward = sched.step_stats.mode("DECODE").seconds["forward"]  # reset after prefill
    row["eager_step_ms"] = 1e3 * statistics.median(eager_steps)
    row["eager_forward_ms"] = {"attention": 1e3 * totals["attention"] / n,
                               "linear": 1e3 * totals["linear"] / n,
                               "other": 1e3 * (forward - totals["attention"] - totals["linear"]) / n}
    return row
