"""bench_scoring.py --case choices (issue 37): multiple-choice scoring, lm-eval style,
with the prompt-logprob cache on vs off (``--disable-prompt-logprob-cache``).

--items questions, each one context of 1,000-2,000 tokens and 4 choices of 1-20 tokens
(first tokens distinct), all from non-overlapping windows of ``corpus_text()``; one
``/v1/completions`` echo request per choice (context + choice ids), in item order,
--concurrency in flight. Each timed round starts from an emptied radix cache
(``/flush_cache``), so only the sharing within a round counts.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shlex
import statistics
import time

import httpx
import psutil

from bench_scoring import (compare, corpus_text, cpu_delta, cpu_seconds, flush, parse_response, request_for,
                           server_setup)
from bench_serving import free_port, launched_server

CTX_LO, CTX_HI, CHOICE_MAX, CHOICES = 1000, 2000, 20, 4
# An idle server using more than this share of one core would slow the other one down
# while it is measured: then the two run one after another instead of alternating. (Below
# it, each side is measured next to the other's idle server, so the ratio is not skewed.)
IDLE_MAX_SHARE = 0.05


def make_items(ids: list[int], n: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """``n`` (context, choices): each context from its own CTX_HI-token window, the choices
    from CHOICE_MAX-token slots of the windows no context uses."""
    windows = len(ids) // CTX_HI
    if windows < n + 1:
        raise SystemExit(f"corpus has {len(ids)} tokens: not enough for {n} contexts of up to {CTX_HI}")
    rnd = random.Random(seed)
    used = rnd.sample(range(windows), n)
    slots = [w * CTX_HI + k * CHOICE_MAX for w in sorted(set(range(windows)) - set(used))
             for k in range(CTX_HI // CHOICE_MAX)]
    rnd.shuffle(slots)
    free = iter(slots)
    items = []
    for w in used:
        ctx = ids[w * CTX_HI: w * CTX_HI + rnd.randint(CTX_LO, CTX_HI)]
        choices: list[list[int]] = []
        while len(choices) < CHOICES:  # a shared first token would share more than the context
            s = next(free, None)
            if s is None:
                raise SystemExit(f"corpus has {len(ids)} tokens: too few left for the choices of {n} items")
            c = ids[s: s + rnd.randint(1, CHOICE_MAX)]
            if all(c[0] != o[0] for o in choices):
                choices.append(c)
        items.append((ctx, choices))
    return items


def prompts_of(items) -> list[list[int]]:
    return [ctx + c for ctx, choices in items for c in choices]  # item 0's choices first


async def score_round(base: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list, int]:
    """One request per prompt, started in order, ``concurrency`` in flight (bench_scoring's
    http_round drops ``usage``, which says how many tokens came from the cache).
    (wall seconds, per-prompt (token logprobs, top-1), cached tokens summed)."""
    gate = asyncio.Semaphore(concurrency)  # FIFO: the requests go out in item order
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(prompt: list[int]) -> tuple[tuple, int]:
            path, body = request_for("echo", [prompt])
            async with gate:
                r = await client.post(base + path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"choices: HTTP {r.status_code}: {r.text[:300]}")
            out = r.json()
            (res,) = parse_response("echo", [prompt], out)
            if len(res[0]) != len(prompt) or any(x is None for x in res[0][1:]):
                raise RuntimeError(f"choices: {len(res[0])} logprobs for {len(prompt)} tokens")
            details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
            return res, details.get("cached_tokens", 0)

        t = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t, [res for res, _ in done], sum(c for _, c in done)


def tree_cpu(pid: int) -> float:
    """CPU seconds so far of process ``pid`` and its descendants (cpu_seconds() names
    processes by title, which does not tell two servers apart)."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += sum(p.cpu_times()[:2])
    return total


def idle_cpu(windows: int = 3, seconds: float = 3.0) -> tuple[float, dict]:
    """The least CPU share (of one core) this process's servers took in ``windows`` idle
    windows, and that window's CPU seconds by process: a steady cost shows in every
    window, a one-off (the grammar pool starting its workers just after /health) in one."""
    best = None
    for _ in range(windows):
        before, t = cpu_seconds(), time.perf_counter()
        time.sleep(seconds)  # the scheduler blocks on its socket when idle: this should cost ~0
        used = cpu_delta(before, cpu_seconds())
        share = sum(v for k, v in used.items() if not k.startswith("client")) / (time.perf_counter() - t)
        if best is None or share < best[0]:
            best = (share, used)
    return best


class Server:
    """One launched server: warm, then timed rounds, each on an emptied cache."""

    def __init__(self, name: str, base: str, pid: int, concurrency: int):
        self.name, self.base, self.pid, self.concurrency = name, base, pid, concurrency
        self.tok_s: list[float] = []
        self.cached: list[int] = []
        self.results: list = []

    def warm(self, prompts: list[list[int]]) -> None:
        asyncio.run(score_round(self.base, prompts, self.concurrency))

    def timed_round(self, r: int, prompts: list[list[int]], tokens: int) -> None:
        flush(self.base)
        wall, self.results, cached = asyncio.run(score_round(self.base, prompts, self.concurrency))
        self.tok_s.append(tokens / wall)
        self.cached.append(cached)
        print(f"  run {r}: {self.name:<9} {tokens / wall:8.1f} tok/s ({wall:.2f} s)", flush=True)


@contextlib.contextmanager
def serve(name: str, argv: list[str], concurrency: int):
    """launched_server, as a Server that knows its launch.py's pid (the one new child:
    its process title may be changed, its pid is not)."""
    known = {p.pid for p in psutil.Process().children()}
    with launched_server(free_port(), shlex.join(argv)) as base:
        (pid,) = {p.pid for p in psutil.Process().children()} - known
        yield Server(name, base, pid, concurrency)


def run(args) -> dict:
    from srt.model_executor.model_loader import resolve_model_path
    from srt.tokenizer_utils import get_tokenizer

    dtype, threads, server_argv, flags = server_setup(args)
    ids = get_tokenizer(resolve_model_path(None)).encode(corpus_text(), add_special_tokens=False)
    items = make_items(ids, args.items, args.seed)
    warm = prompts_of(make_items(ids, min(4, args.items), args.seed + 1))  # other items: nothing cached
    prompts = prompts_of(items)
    tokens = sum(map(len, prompts))
    reusable = sum((CHOICES - 1) * len(ctx) for ctx, _ in items)  # choices 2-4 of each item
    ctx_lens = [len(ctx) for ctx, _ in items]
    print(f"choices: {args.items} items x {CHOICES} choices = {len(prompts)} requests, {tokens} prompt tokens "
          f"(contexts {min(ctx_lens)}..{max(ctx_lens)} tokens), concurrency={args.concurrency} runs={args.runs}")
    argv = {"cache on": server_argv, "cache off": server_argv + ["--disable-prompt-logprob-cache"]}
    other_cpu: list[float] = []  # the idle server's CPU seconds during the other's rounds

    with serve("cache on", argv["cache on"], args.concurrency) as on:
        on.warm(warm)
        idle_share, idle = idle_cpu()
        together = idle_share <= IDLE_MAX_SHARE
        print(f"idle server: {idle_share:.3f} of a core (" + ", ".join(
            f"{k} {v:.2f} s" for k, v in idle.items() if v >= 0.005) + f") -> "
            f"{'both up, alternating' if together else 'one after another'}", flush=True)
        if together:
            with serve("cache off", argv["cache off"], args.concurrency) as off:
                off.warm(warm)
                for r in range(args.runs):  # alternate: the CPU's drift hits both alike
                    for me, other in ((on, off), (off, on)):
                        c0 = tree_cpu(other.pid)
                        me.timed_round(r, prompts, tokens)
                        other_cpu.append(tree_cpu(other.pid) - c0)
        else:
            for r in range(args.runs):
                on.timed_round(r, prompts, tokens)
    if not together:
        with serve("cache off", argv["cache off"], args.concurrency) as off:
            off.warm(warm)
            for r in range(args.runs):
                off.timed_round(r, prompts, tokens)

    return summarize(args, on, off, {
        "dtype": dtype, "threads": threads, "cpu_flags": flags, "items": args.items, "prompt_tokens": tokens,
        "reusable_tokens": reusable, "servers_together": together, "idle_share": idle_share,
        "idle_server_cpu_s": other_cpu})


def summarize(args, on: Server, off: Server, meta: dict) -> dict:
    """Prints the summary and the target line; returns every figure (for --json)."""
    med_on, med_off = statistics.median(on.tok_s), statistics.median(off.tok_s)
    per_round = [a / b for a, b in zip(on.tok_s, off.tok_s)]  # same round: the CPU's state is shared
    ratio, paired = med_on / med_off, statistics.median(per_round)
    diff = compare(on.results, off.results)  # the last round's, token by token
    same = sum(a == b for (x, _), (y, _) in zip(on.results, off.results) for a, b in zip(x[1:], y[1:]))
    meta["load_average_end"] = load = os.getloadavg()[0]
    flags = " ".join(k for k, v in meta["cpu_flags"].items() if v) or "-"
    how = "up together, alternating" if meta["servers_together"] else "one after another"
    print(f"\n=== multiple choice: {args.items} items x {CHOICES}, {meta['prompt_tokens']} prompt tokens, "
          f"concurrency {args.concurrency}, dtype {meta['dtype']}, threads {meta['threads']}, flags {flags} "
          f"(medians of {args.runs}; servers {how}; load average now {load:.2f}) ===")
    for s in (on, off):
        print(f"{s.name:<10}{statistics.median(s.tok_s):9.1f} tok/s   runs {', '.join(f'{x:.0f}' for x in s.tok_s)}"
              f"   cached tokens per round {', '.join(map(str, s.cached))} (of at most ~{meta['reusable_tokens']})")
    print(f"on / off: {ratio:.2f}x (ratio of medians); per round {', '.join(f'{x:.2f}' for x in per_round)} "
          f"(median {paired:.2f}x)")
    # Breakdown: the speed-up is the prefill the cache saves, at whatever rate the rest runs.
    for s in (on, off):
        computed = meta["prompt_tokens"] - statistics.median(s.cached)
        rate = computed * statistics.median(s.tok_s) / meta["prompt_tokens"]
        print(f"  {s.name}: {computed:.0f} of {meta['prompt_tokens']} prompt tokens prefilled per round, "
              f"at {rate:.1f} tok/s prefilled")
    print(f"|logprob diff| on vs off (last round): max {diff['max_abs_diff']:.3g} mean {diff['mean_abs_diff']:.3g}; "
          f"bitwise identical {same}/{diff['tokens']} tokens")
    if meta["idle_server_cpu_s"]:
        print(f"idle server's CPU during the other's rounds: max {max(meta['idle_server_cpu_s']):.2f} s "
              f"(alone and idle before: {meta['idle_share']:.3f} of a core)")
    print(f"target (issue 37): multiple-choice, logprob cache on vs off >= 3x tokens scored/s -> {ratio:.2f}x "
          f"(ratio of medians), {paired:.2f}x (median of per-round ratios): "
          f"{'MET' if min(ratio, paired) >= 3 else 'NOT MET'}")
    return {**meta, "ratio": ratio, "paired_ratio": paired, "paired_ratios": per_round,
            "max_abs_diff": diff["max_abs_diff"], "mean_abs_diff": diff["mean_abs_diff"],
            "identical_tokens": same, "compared_tokens": diff["tokens"],
            **{s.name.replace(" ", "_"): {"tok_s": statistics.median(s.tok_s), "runs": s.tok_s,
                                          "cached_tokens": s.cached} for s in (on, off)}}
