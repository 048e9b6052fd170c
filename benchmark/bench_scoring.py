"""Scoring speed (issue 20): prompt logprobs through the server vs transformers in process.

    .venv/bin/python benchmark/bench_scoring.py [--num-prompts 200] [--concurrency 16]
        [--runs 3] [--dtype auto] [--port 0] [--server-args "--wait-for-torch-compile"]
        [--modes echo,echo-batch,generate] [--profile] [--json out.json]
        [--case single|choices|all] [--items 32]

Workload: --num-prompts deterministic prompts of --min-len..--max-len tokens (default
48..80, ~64 on average, as real eval contexts vary), cut from ordinary English prose
(Python's own documentation, ``pydoc_data.topics``, shipped with the interpreter: no
downloads), whitespace collapsed, non-overlapping (no shared prefixes for the radix cache
to flatter). Both sides get the same token-id lists, so they score exactly the same tokens.

Ours: the real server (``launch.py`` in its own process group, always stopped at the end),
--concurrency workers each sending one prompt per request, after a warm-up round; every
round starts from an emptied radix cache (``/flush_cache``; the in-process scheduler's too),
or the prompts of the earlier rounds would come back whole from the prompt-logprob cache:
- ``echo``: ``/v1/completions`` with ``echo: true, max_tokens: 0, logprobs: 1``;
- ``echo-batch``: the same with ``prompt`` a list of --concurrency token-id lists per
  request (one choice per prompt), the requests in flight together;
- ``generate``: the native ``/generate`` with ``max_new_tokens: 1, return_logprob,
  logprob_start_len: 0, top_logprobs_num: 1`` (prompt logprobs in
  ``meta_info.input_token_logprobs``; one generated token per prompt on top).
tokens/s = prompt tokens scored / wall time of the round.

Reference: transformers ``AutoModelForCausalLM`` from the same converted directory, same
dtype and thread count as the server's scheduler, ``torch.inference_mode``, ``use_cache``
off, batches of --concurrency in the prompts' order, right-padded with an attention mask;
fp32 ``log_softmax`` over the logits (as the server computes prompt logprobs), gather of
each prompt token's logprob and the top-1 (the server returns ``logprobs: 1``). It runs
while the server is idle; ours and the reference alternate within each of --runs rounds,
and medians are reported with every run's value, plus each round's ours/reference ratio
(the two sides of one round share the CPU's state: this CPU's speed drifts by 20-40%
between minutes, so the per-round ratios are the steadier figure). The target line needs
both the ratio of medians and the median per-round ratio at >= 1.5.

Correctness: max / mean abs difference between the server's prompt token logprobs and
the reference's, per token, and how often the top-1 logprob agrees to 0.05 (bf16 noise).

Breakdown (profile first): the server does not expose its step counters over HTTP, so
the same scoring runs on an in-process ``Scheduler`` built from the same server flags,
with the same number of requests in flight: model body (attention / linear / other),
LM head, prompt-logprob work (``record_prompt_logprobs``: log_softmax, gather, top-k,
``tolist``), sampling, scheduler bookkeeping; HTTP + frontend + IPC is the server's wall
time minus the in-process one. The reference splits into forward and log_softmax/gather,
and names its padding share. --profile adds cProfile's and torch.profiler's top entries
for the in-process run. The CPU seconds each server process (scheduler, frontend) and the
client used per HTTP round show whether the frontend or the client compete for the two
cores. The compute floor is the matmul work per scored token (LM head over every prompt
row included) at this run's measured bf16/fp32 matmul peak.

--server-args defaults to ``--wait-for-torch-compile``: prefill runs compiled
(``srt/model_executor/compiled/prefill.py``) once the start-up compile is over, so the server, and the
in-process scheduler built from the same flags, report ready only then (a few minutes:
the decode graphs compile too). ``--server-args --disable-torch-compile`` measures the
eager prefill (the in-process run checks that no decode step happened either way).

--case choices (issue 37; benchmark/scoring_choices.py; --case all: single, then this):
multiple-choice scoring as lm-evaluation-harness sends it. --items questions (default 32),
each a context of 1,000-2,000 tokens and 4 choices of 1-20 tokens (distinct first tokens),
from non-overlapping corpus windows chosen by --seed; one echo request per choice (context
+ choice ids), in item order, --concurrency in flight. Two servers from --server-args and
--dtype, one with --disable-prompt-logprob-cache; both stay up and alternate within each of
--runs rounds if an idle server costs no CPU (measured first), else they run one after the
other. Each is warmed on other items, and every timed round starts with ``/flush_cache``.
Reported: tokens scored/s on and off, their ratio (of medians and per round; the target
needs both >= 3), the cached tokens the server reports in ``usage``, and how far the
logprobs on and off differ.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import re
import shlex
import statistics
import sys
import time

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine_floor  # noqa: E402
from bench_serving import free_port, launched_server  # noqa: E402

MODES = ("echo", "echo-batch", "generate")


# ---- prompts ------------------------------------------------------------------------
def corpus_text() -> str:
    """Ordinary English prose that ships with Python: the interpreter's documentation."""
    import pydoc_data.topics as topics

    return "\n".join(re.sub(r"\s+", " ", topics.topics[k]).strip() for k in sorted(topics.topics))


def make_prompts(tok, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` token-id lists of ``lo``..``hi`` tokens, from non-overlapping corpus windows."""
    ids = tok.encode(corpus_text(), add_special_tokens=False)
    windows = len(ids) // hi
    if windows < n:
        raise SystemExit(f"corpus has {len(ids)} tokens: not enough for {n} prompts of up to {hi}")
    rnd = random.Random(seed)
    starts = rnd.sample(range(windows), n)
    return [ids[s * hi: s * hi + rnd.randint(lo, hi)] for s in starts]


# ---- ours, over HTTP ----------------------------------------------------------------
def request_for(mode: str, batch: list[list[int]]) -> tuple[str, dict]:
    if mode == "generate":
        return "/generate", {"input_ids": batch[0], "return_logprob": True, "logprob_start_len": 0,
                             "top_logprobs_num": 1,
                             "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    prompt = batch[0] if mode == "echo" else batch
    return "/v1/completions", {"model": "default", "prompt": prompt, "echo": True, "max_tokens": 0,
                               "logprobs": 1, "temperature": 0}


def parse_response(mode: str, batch: list[list[int]], body: dict) -> list[tuple[list, list]]:
    """Per prompt: (token logprobs, first None; top-1 logprob per position, first None)."""
    if mode == "generate":
        meta = body["meta_info"]
        rows = meta["input_token_logprobs"]
        assert [t for _, t, *_ in rows] == batch[0], "server scored other tokens than sent"
        tops = [max((e[0] for e in top), default=None) if top else None
                for top in meta.get("input_top_logprobs") or [None] * len(rows)]
        return [([lp for lp, *_ in rows], tops)]
    out = []
    for choice in sorted(body["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        n = len(batch[choice["index"]])
        tops = [max(t.values()) if t else None for t in (lp.get("top_logprobs") or [None] * n)[:n]]
        out.append((lp["token_logprobs"][:n], tops))
    assert len(out) == len(batch), f"{len(out)} choices for {len(batch)} prompts"
    return out


async def http_round(base: str, mode: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list]:
    """All prompts through --concurrency workers; (wall seconds, per-prompt results)."""
    per = concurrency if mode == "echo-batch" else 1
    jobs = [list(range(i, min(i + per, len(prompts)))) for i in range(0, len(prompts), per)]
    results: list = [None] * len(prompts)
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while not queue.empty():
                idx = queue.get_nowait()
                batch = [prompts[i] for i in idx]
                path, body = request_for(mode, batch)
                r = await client.post(base + path, json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{mode}: HTTP {r.status_code}: {r.text[:300]}")
                for i, res in zip(idx, parse_response(mode, batch, r.json())):
                    results[i] = res

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
        return time.perf_counter() - t, results


def flush(base: str) -> None:
    """Empty the server's radix cache (and the prompt logprobs kept with it), so a round
    scores cold; 400 while requests still run."""
    for _ in range(100):
        r = httpx.post(base + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"/flush_cache: HTTP {r.status_code}: {r.text[:200]}")


def mode_available(base: str, mode: str, prompt: list[int]) -> str | None:
    """None if the server answers ``mode`` correctly, else why not."""
    path, body = request_for(mode, [prompt, prompt] if mode == "echo-batch" else [prompt])
    try:
        r = httpx.post(base + path, json=body, timeout=120)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:200]}"
        res = parse_response(mode, [prompt, prompt] if mode == "echo-batch" else [prompt], r.json())
        lps = res[0][0]
        if len(lps) != len(prompt) or lps[0] is not None or any(x is None for x in lps[1:]):
            return f"unexpected token_logprobs shape: {str(lps)[:200]}"
    except (httpx.HTTPError, KeyError, TypeError, ValueError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far (user + system, all threads) by this benchmark's process (the
    HTTP client; the reference and in-process runs add to it only between rounds) and by
    each server process, named by its process title (gramsync::frontend, ...)."""
    import psutil

    me = psutil.Process()
    out = {"client (this process)": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            name = " ".join(child.cmdline())[:40] or child.name()
            name = name.split()[0] if name.startswith("gramsync::") else "launch.py (parent)"
            out[name] = out.get(name, 0.0) + sum(child.cpu_times()[:2])
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# ---- reference: transformers in process ---------------------------------------------
class Reference:
    def __init__(self, model_dir: str, dtype: torch.dtype, pad_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.pad_id = pad_id

    @torch.inference_mode()
    def score(self, prompts: list[list[int]], batch: int) -> tuple[float, dict, list]:
        """(wall seconds, {forward, logprobs, padded_tokens}, per-prompt results)."""
        results, split = [], {"forward": 0.0, "logprobs": 0.0, "padded_tokens": 0}
        t_all = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([p + [self.pad_id] * (width - len(p)) for p in chunk])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in chunk])
            split["padded_tokens"] += ids.numel()
            t0 = time.perf_counter()
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            t1 = time.perf_counter()
            lp = torch.log_softmax(logits[:, :-1], dim=-1, dtype=torch.float32)
            chosen = lp.gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1).tolist()
            top1 = lp.max(dim=-1).values.tolist()
            for row, p in enumerate(chunk):
                n = len(p) - 1
                results.append(([None] + chosen[row][:n], [None] + top1[row][:n]))
            split["forward"] += t1 - t0
            split["logprobs"] += time.perf_counter() - t1
        return time.perf_counter() - t_all, split, results


def compare(ours: list, ref: list) -> dict:
    diffs, top_ok, top_n = [], 0, 0
    for (lo, to), (lr, tr) in zip(ours, ref):
        diffs += [abs(a - b) for a, b in zip(lo[1:], lr[1:])]
        for a, b in zip(to[1:], tr[1:]):
            if a is not None:
                top_n += 1
                top_ok += abs(a - b) < 0.05
    return {"max_abs_diff": max(diffs), "mean_abs_diff": statistics.fmean(diffs), "tokens": len(diffs),
            "top1_agree": top_ok / top_n if top_n else None}


# ---- in-process breakdown ------------------------------------------------------------
def server_args_for(model_dir: str, server_argv: list[str]):
    from srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(server_argv))
    return dataclasses.replace(args, model_path=model_dir, random_seed=args.random_seed or 0)


class Timers:
    """Forward hooks: model body's attention / linear layers, LM head (with the compiled
    prefill: body and attention only, called eagerly between the graphs); and wrapped
    prompt-logprob bookkeeping (log_softmax + gather + top-k + tolist)."""

    def __init__(self, sched, compiled_prefill: bool):
        import srt.scheduler.batch_step as sched_mod  # where the batch phases call it
        from srt.layers.attention import Attention
        from srt.layers.linear import _TPLinear

        self.t = dict.fromkeys(("body", "attention", "linear", "lm_head", "prompt_logprobs"), 0.0)
        self._handles, starts = [], {}
        model = sched.runner.model

        def timed(mod, cat):
            self._handles.append(mod.register_forward_pre_hook(
                lambda m, a: starts.__setitem__(id(m), time.perf_counter())))
            self._handles.append(mod.register_forward_hook(
                lambda m, a, o: self.t.__setitem__(cat, self.t[cat] + time.perf_counter() - starts[id(m)])))

        timed(model.model, "body")
        if not compiled_prefill:  # compiled: linear layers and LM head run inside graphs
            timed(model.lm_head, "lm_head")
        for m in model.model.modules():
            if isinstance(m, Attention):
                timed(m, "attention")
            elif isinstance(m, _TPLinear) and not compiled_prefill:
                timed(m, "linear")
        self._mod, self._orig = sched_mod, sched_mod.record_prompt_logprobs

        def record(*a, **k):
            t = time.perf_counter()
            try:
                return self._orig(*a, **k)
            finally:
                self.t["prompt_logprobs"] += time.perf_counter() - t

        sched_mod.record_prompt_logprobs = record

    def reset(self):
        self.t = dict.fromkeys(self.t, 0.0)

    def close(self):
        for h in self._handles:
            h.remove()
        self._mod.record_prompt_logprobs = self._orig


def inprocess_round(sched, prompts, concurrency: int, max_new: int, tag: str) -> tuple[float, list]:
    """Score every prompt with ``concurrency`` requests in flight, as the server sees
    them; (wall seconds, per-prompt results)."""
    from sampling.sampling_params import SamplingParams
    from srt.transport.io_struct import LogprobRequest, TokenizedGenerateReq

    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new})
    lp_req = LogprobRequest(top_n=1, start_len=0)
    # Cold, as every round: prompts scored before would come whole from the radix cache.
    assert sched.kv.flush_cache(), "in-process scheduler not idle"
    results: list = [None] * len(prompts)
    nxt, inflight = 0, 0
    t = time.perf_counter()
    while nxt < len(prompts) or inflight:
        new = []
        while nxt < len(prompts) and inflight < concurrency:
            new.append(TokenizedGenerateReq(f"{tag}-{nxt}", tuple(prompts[nxt]), params, logprobs=lp_req))
            nxt, inflight = nxt + 1, inflight + 1
        sched.process_input_requests(new)
        for out in sched.step():
            for k, rid in enumerate(out.rids):
                i = int(rid.rsplit("-", 1)[1])
                if out.input_logprobs and out.input_logprobs[k] is not None:
                    ilp = out.input_logprobs[k]
                    tops = [max((v for _, v in top), default=None) if top else None for top in ilp.top]
                    results[i] = (list(ilp.token_logprobs), tops)
                if out.finished_reasons[k] is not None:
                    inflight -= 1
    return time.perf_counter() - t, results


class InProcess:
    """A ``Scheduler`` built from the server's own flags, in this process: timed in each
    round next to the server (same CPU state), then split by hooks once at the end."""

    def __init__(self, model_dir, server_argv, prompts, concurrency):
        from transformers import AutoTokenizer

        from distributed.parallel_state import SINGLE_RANK, RankInfo
        from srt.scheduler.scheduler import Scheduler
        from srt.model_executor.model_config import ModelConfig

        self.args = args = server_args_for(model_dir, server_argv)
        self.sched = Scheduler(args, RankInfo(), SINGLE_RANK,
                               ModelConfig.from_path(model_dir, args.context_length),
                               AutoTokenizer.from_pretrained(model_dir))
        self.prompts, self.concurrency = prompts, concurrency
        # max_new_tokens 0 (echo's) if the scheduler scores such a prompt, else 1 (as /generate).
        _, probe = inprocess_round(self.sched, prompts[:2], 2, 0, "probe")
        self.max_new = 0 if all(r is not None for r in probe) else 1
        inprocess_round(self.sched, prompts[:concurrency], concurrency, self.max_new, "warm")
        self.walls, self.results = [], None

    def timed_round(self) -> float:  # as served: no hooks
        wall, self.results = inprocess_round(self.sched, self.prompts, self.concurrency, self.max_new,
                                             f"run{len(self.walls)}")
        self.walls.append(wall)
        return wall

    def finish(self, profile: bool) -> dict:
        sched = self.sched
        sched.step_stats.reset()
        compiled = sched.runner.compiled_prefill is not None and sched.runner.compiled_prefill.ready
        timers = Timers(sched, compiled)  # one more round, split by hooks (they add a little time)
        try:
            hooked, _ = inprocess_round(sched, self.prompts, self.concurrency, self.max_new, "split")
        finally:
            timers.close()
        phases = {**{f"{m}:{k}": v for m, pt in sched.step_stats.by_mode.items()
                     for k, v in pt.seconds.items()}, **timers.t}
        steps = {m: pt.steps for m, pt in sched.step_stats.by_mode.items()}
        row = {"max_new_tokens": self.max_new, "wall_s": self.walls, "hooked_wall_s": hooked,
               "phases_s": phases, "steps": steps, "results": self.results,
               "chunked_prefill_size": sched.chunk_size, "compiled_prefill": compiled, "max_prefill_tokens": self.args.max_prefill_tokens,
               "threads": torch.get_num_threads()}
        if profile:
            row["profile"] = run_profiles(sched, self.prompts, self.concurrency, self.max_new)
        self.sched = None
        return row


def run_profiles(sched, prompts, concurrency, max_new) -> str:
    out = io.StringIO()
    prof = cProfile.Profile()
    prof.enable()
    inprocess_round(sched, prompts, concurrency, max_new, "cprof")
    prof.disable()
    out.write("\n--- cProfile of one in-process round (top 25 by own time) ---\n")
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as tp:
        inprocess_round(sched, prompts, concurrency, max_new, "tprof")
    out.write("\n--- torch.profiler of one in-process round (top 25 ops by self CPU time) ---\n")
    out.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return out.getvalue()


# ---- report --------------------------------------------------------------------------
def print_breakdown(n_tokens: int, server_walls: list | None, head: str | None, ip: dict, ref_split: dict,
                    ref_wall: float, real_tokens: int, floor: dict | None) -> None:
    wall, hooked = statistics.median(ip["wall_s"]), ip["hooked_wall_s"]
    ph, steps = ip["phases_s"], ip["steps"]
    ext = steps.get("EXTEND", 0)
    print(f"\nbreakdown, ours: in-process Scheduler, same flags, same in-flight count "
          f"(max_new_tokens={ip['max_new_tokens']}, chunked_prefill_size={ip['chunked_prefill_size']}, "
          f"max_prefill_tokens={ip['max_prefill_tokens']}, threads={ip['threads']})")
    print(f"  steps: {steps} -> {n_tokens / max(ext, 1):.0f} prompt tokens per prefill step")
    if steps.get("DECODE"):
        print("  WARNING: decode steps ran: scoring is not prefill-only here")
    body = ph["body"]
    if ip["compiled_prefill"]:  # hooks inside the compiled halves would break their graphs
        split = [("  linear layers, norms, rotary, MLP (compiled)", body - ph["attention"])]
        head_row = ("final norm + LM head (compiled), row gather", None)
    else:
        split = [("  linear layers", ph["linear"]),
                 ("  other (norms, rotary, embed, adds)", body - ph["attention"] - ph["linear"])]
        head_row = ("LM head (matmul, + any fp32 copy of the logits)", ph["lm_head"])
    rows = [(f"model body ({'compiled around attention' if ip['compiled_prefill'] else 'eager'})", body),
            ("  attention (eager: SDPA per sequence, KV writes)", ph["attention"]), *split]
    if head_row[1] is not None:
        rows.append(head_row)
    rows += [
            ("prompt logprobs (log_softmax, gather, top-k, tolist)", ph["prompt_logprobs"]),
            ("sampling (1 row per request)", sum(v for k, v in ph.items() if k.endswith(":sampling"))),
            ("scheduler bookkeeping, outputs", sum(v for k, v in ph.items() if k.endswith(":scheduler"))),
            ("forward phase, rest (" + ("final norm + LM head (compiled), " if head_row[1] is None else
                                        "final norm, ") + "row gather)",
             sum(v for k, v in ph.items() if k.endswith(":forward")) - body - ph["lm_head"] - ph["prompt_logprobs"])]
    print(f"  {'in-process wall (median, no hooks)':<56}{wall:8.2f} s  {n_tokens / wall:8.0f} tok/s")
    print(f"  {'in-process wall of the split round (hooks on)':<56}{hooked:8.2f} s  (shares below are of this)")
    for name, v in rows:
        print(f"  {name:<56}{v:8.2f} s  {100 * v / hooked:5.1f}%  {1e3 * v / max(ext, 1):7.1f} ms/step")
    if server_walls:
        extra = [sw - w for sw, w in zip(server_walls, ip["wall_s"])]  # same round each
        sw = statistics.median(server_walls)
        print(f"  {'HTTP + frontend + IPC (ours/' + head + ' - in-process, per round)':<56}"
              f"{statistics.median(extra):8.2f} s  {100 * statistics.median(extra) / sw:5.1f}% of the server's "
              f"wall (rounds: {', '.join(f'{x:.2f}' for x in extra)})")
    print(f"breakdown, reference (transformers, median run): wall {ref_wall:.2f} s = forward "
          f"{ref_split['forward']:.2f} s ({100 * ref_split['forward'] / ref_wall:.0f}%) + log_softmax/gather/"
          f"tolist {ref_split['logprobs']:.2f} s ({100 * ref_split['logprobs'] / ref_wall:.0f}%); "
          f"padding: {ref_split['padded_tokens']} positions for {real_tokens} tokens "
          f"({100 * (1 - real_tokens / ref_split['padded_tokens']):.0f}% wasted)")
    if floor is not None:
        need = real_tokens * floor["per_row_gflop"] / floor["peak_gflops"]
        print(f"compute floor: {floor['per_row_gflop']:.3f} GFLOP of matmuls per scored token (LM head "
              f"included) at this run's {floor['peak_gflops']:.0f} GFLOP/s matmul peak -> {need:.2f} s "
              f"({real_tokens / need:.0f} tok/s); transformers computes {ref_split['padded_tokens']} positions")


def main() -> None:
    from srt.model_executor.cpu_allocator import reexec_with_allocator

    reexec_with_allocator()  # measure with the allocator the server's ranks use
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight; the reference's batch size")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--min-len", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="both sides (auto: the server's rule: bf16 with AVX512-BF16/AMX, else fp32)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--server-args", default="--wait-for-torch-compile", help="more launch.py flags")
    ap.add_argument("--modes", default=",".join(MODES), help=f"ours: any of {','.join(MODES)}")
    ap.add_argument("--skip-breakdown", action="store_true", help="no in-process breakdown")
    ap.add_argument("--profile", action="store_true", help="cProfile + torch.profiler of the in-process run")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--case", default="single", choices=["single", "choices", "all"],
                    help="single: the prompts above; choices: multiple-choice, logprob cache on vs off; all: both")
    ap.add_argument("--items", type=int, default=32, help="choices: questions (4 choices each)")
    args = ap.parse_args()
    report = score_single(args) if args.case in ("single", "all") else {"args": vars(args)}
    if args.case in ("choices", "all"):
        import scoring_choices  # it imports this module: at the top the import would be circular

        report["choices"] = scoring_choices.run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


def server_setup(args) -> tuple[str, int, list[str], dict]:
    """(dtype, threads, launch.py flags, CPU flags) for ``args``; prints the header line."""
    from srt.model_executor.model_runner import resolve_dtype
    from srt.server_args import ServerArgs

    dtype = str(resolve_dtype(ServerArgs(dtype=args.dtype), "cpu")).removeprefix("torch.")
    # The scheduler's rule (scheduler_process.py): the node's cores, capped by OMP_NUM_THREADS.
    threads = min(os.cpu_count() or 1, torch.get_num_threads())
    torch.set_num_threads(threads)
    server_argv = shlex.split(args.server_args) + ["--dtype", dtype]
    flags = machine_floor.cpu_flags()
    print(f"cpu={machine_floor.cpu_model()} flags={flags} dtype={dtype} threads={threads} "
          f"load average at start {os.getloadavg()[0]:.2f} (other work on these cores skews every figure)")
    return dtype, threads, server_argv, flags


def score_single(args) -> dict:
    """The --case single benchmark (the module docstring's first part); returns its report."""
    torch.set_grad_enabled(False)

    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import get_tokenizer

    model_dir = resolve_model_path(None)
    tok = get_tokenizer(model_dir)
    dtype, threads, server_argv, flags = server_setup(args)
    prompts = make_prompts(tok, args.num_prompts, args.min_len, args.max_len, args.seed)
    n_tokens = sum(len(p) for p in prompts)
    scored = n_tokens  # every prompt token is a position of the answer (the first one's is null)
    print(f"prompts={args.num_prompts} tokens={n_tokens} (len {min(map(len, prompts))}..{max(map(len, prompts))}, "
          f"mean {n_tokens / len(prompts):.1f}) concurrency={args.concurrency} runs={args.runs}")
    report = {"args": vars(args), "cpu": machine_floor.cpu_model(), "cpu_flags": flags, "dtype": dtype,
              "threads": threads, "prompt_tokens": n_tokens, "ours": {}, "unavailable": {}}

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ref = Reference(model_dir, getattr(torch, dtype), pad_id)
    ref.score(prompts[:args.concurrency], args.concurrency)  # warm-up
    ref_runs, ref_splits, ref_results = [], [], None
    ours_runs: dict[str, list[float]] = {}
    ours_results: dict[str, list] = {}
    ours_cpu: dict[str, list] = {}
    port = args.port or free_port()
    inproc = None if args.skip_breakdown else InProcess(model_dir, server_argv, prompts, args.concurrency)
    with launched_server(port, " ".join(shlex.quote(a) for a in server_argv)) as base:
        info = httpx.get(base + "/get_server_info", timeout=10).json()
        print(f"server: dtype={info.get('dtype')} chunked_prefill_size={info.get('chunked_prefill_size')} "
              f"max_prefill_tokens={info.get('max_prefill_tokens')} max_running_requests="
              f"{info.get('max_running_requests')} torch_compile={not info.get('disable_torch_compile')}")
        modes = []
        for mode in args.modes.split(","):
            why = mode_available(base, mode, prompts[0])
            if why is None:
                modes.append(mode)
            else:
                report["unavailable"][mode] = why
                print(f"ours/{mode}: not available: {why}")
        for mode in modes:  # warm-up round, the timed one's shape
            asyncio.run(http_round(base, mode, prompts[:2 * args.concurrency], args.concurrency))
        for r in range(args.runs):  # alternate: drift of the CPU hits both sides alike
            for mode in modes:
                flush(base)  # the same prompts each round: scored cold, not from the cache
                before = cpu_seconds()
                wall, res = asyncio.run(http_round(base, mode, prompts, args.concurrency))
                ours_cpu.setdefault(mode, []).append((wall, cpu_delta(before, cpu_seconds())))
                ours_runs.setdefault(mode, []).append(scored / wall)
                ours_results[mode] = res
                print(f"  run {r}: ours/{mode:<10} {scored / wall:8.1f} tok/s ({wall:.2f} s)", flush=True)
            if inproc is not None:
                wall = inproc.timed_round()
                print(f"  run {r}: in-process sched {scored / wall:8.1f} tok/s ({wall:.2f} s)", flush=True)
            wall, split, ref_results = ref.score(prompts, args.concurrency)
            ref_runs.append(scored / wall)
            ref_splits.append((wall, split))
            print(f"  run {r}: transformers    {scored / wall:8.1f} tok/s ({wall:.2f} s)   load average "
                  f"{os.getloadavg()[0]:.2f} (ours + reference use ~2)", flush=True)
        ip, floor = None, None
        if not args.skip_breakdown:
            peak = machine_floor.matmul_peak_gflops(getattr(torch, dtype))
            floor = {**machine_floor.model_floors(ref.model, getattr(torch, dtype), 1.0, peak), "peak_gflops": peak}
            report["floor"] = floor  # server idle; in-process scheduler in this process
            ip = inproc.finish(args.profile)

    ref_med = statistics.median(ref_runs)
    report["load_average_end"] = os.getloadavg()[0]
    print(f"\n=== scoring: {args.num_prompts} prompts, {n_tokens} prompt tokens, concurrency/batch "
          f"{args.concurrency}, dtype {dtype}, threads {threads}, flags "
          f"{' '.join(k for k, v in flags.items() if v) or '-'} (medians of {args.runs}; load average now {report['load_average_end']:.2f}) ===")
    print(f"{'transformers (batches of %d)' % args.concurrency:<32}{ref_med:9.1f} tok/s   runs "
          f"{', '.join(f'{x:.0f}' for x in ref_runs)}")
    report["transformers"] = {"tok_s": ref_med, "runs": ref_runs}
    for mode in ours_runs:
        med = statistics.median(ours_runs[mode])
        paired = [o / t for o, t in zip(ours_runs[mode], ref_runs)]  # same round: same CPU state
        cmp = compare(ours_results[mode], ref_results)
        report["ours"][mode] = {"tok_s": med, "runs": ours_runs[mode], "ratio": med / ref_med,
                                "paired_ratios": paired, "paired_ratio": statistics.median(paired), **cmp}
        print(f"{'ours/' + mode:<32}{med:9.1f} tok/s   runs {', '.join(f'{x:.0f}' for x in ours_runs[mode])}"
              f"   ratio {med / ref_med:.2f}x (per round {', '.join(f'{x:.2f}' for x in paired)}; "
              f"median {statistics.median(paired):.2f}x)")
        print(f"{'':<32}|logprob diff| vs transformers: max {cmp['max_abs_diff']:.3f} mean "
              f"{cmp['mean_abs_diff']:.4f} over {cmp['tokens']} tokens; top-1 logprob within 0.05: "
              f"{cmp['top1_agree']:.3f}")
    print("CPU seconds per round by process (median-wall round; 2 cores give 2 x wall):")
    for mode, rounds in ours_cpu.items():
        wall, cpu = sorted(rounds, key=lambda x: x[0])[len(rounds) // 2]
        report["ours"][mode]["cpu_s"] = cpu
        print(f"  ours/{mode:<10} wall {wall:5.2f} s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.005))
    head = "echo" if "echo" in ours_runs else next(iter(ours_runs), None)
    if head is not None:
        ratio = report["ours"][head]["ratio"]
        paired = report["ours"][head]["paired_ratio"]
        print(f"target (issue 20): ours/{head} >= 1.5x transformers -> {ratio:.2f}x (ratio of medians), "
              f"{paired:.2f}x (median of per-round ratios): {'MET' if min(ratio, paired) >= 1.5 else 'NOT MET'}")
    ref_wall, ref_split = sorted(ref_splits, key=lambda x: x[0])[len(ref_splits) // 2]
    if ip is not None:
        server_walls = [scored / x for x in ours_runs[head]] if head else None
        print_breakdown(n_tokens, server_walls, head, ip, ref_split, ref_wall, n_tokens, floor)
        ipc = compare(ip["results"], ref_results) if all(x is not None for x in ip["results"]) else None
        if ipc:
            print(f"  in-process vs reference: |logprob diff| max {ipc['max_abs_diff']:.3f} "
                  f"mean {ipc['mean_abs_diff']:.4f}")
        report["inprocess"] = {k: v for k, v in ip.items() if k not in ("results", "profile")}
        if "profile" in ip:
            print(ip["profile"])
    return report


if __name__ == "__main__":
    main()
