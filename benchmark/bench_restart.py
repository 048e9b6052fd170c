"""A restart serves at compiled speed without compiling; a first start serves while it compiles.

    .venv/bin/python benchmark/bench_restart.py [--dtype auto] [--streams 8] [--tokens 200]

Three real servers (embedded SmolLM2, TP=1), one after the other, with a compile cache
folder of this run's own (``GRAMSYNC_COMPILE_CACHE_DIR``, removed at the end):

1. compile off (``--disable-torch-compile``): --streams greedy requests of --tokens tokens
   sent together as soon as it is healthy; their output tokens/s; then batch-1 ms/token.
2. first start, compile on (the default), empty folder: the same streams sent as soon as it
   is healthy, while the builder process compiles, and again as soon as the builder is
   done, while the rank loads the build (Dynamo traces in the rank: the part that still
   shares the rank's GIL); their tokens/s against step 1 in the same run (the issue's
   case: the in-process compile thread nearly stopped serving); then seconds until the
   rank logs its compiled steps ready.
3. restart, same folder: ``restart to compiled: <s> s``, from launching the server to the
   rank's "compiled steps ready" line (no Inductor cache miss); then batch-1 ms/token
   against step 1.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compile_pool import cpu_flags  # noqa: E402
from bench_serving import free_port, launched_server  # noqa: E402
from bench_tp_collectives import per_token_ms  # noqa: E402

READY = re.compile(r"INFO srt\.model_executor\.model_runner: .*compiled steps ready \(Inductor's cache: (hits \d+, misses \d+, bypassed \d+)\)")
BUILT = re.compile(r"compile builder done")
TOPICS = ["the sea", "a city at night", "winter", "a library", "trains", "the moon", "bread", "rain"]


def streams_tok_s(base: str, n: int, tokens: int) -> tuple[float, float]:
    """(output tokens/s, seconds) of ``n`` greedy requests sent together."""
    def one(i: int) -> int:
        body = {"text": f"Write a long story about {TOPICS[i % len(TOPICS)]}.",
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        return len(httpx.post(base + "/generate", json=body, timeout=1800).json()["output_ids"])

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        done = sum(pool.map(one, range(n)))
    wall = time.perf_counter() - t
    return done / wall, wall


def wait_for(log_path: str, pattern: re.Pattern, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            m = pattern.search(f.read())
        if m:
            return m.group(m.re.groups and 1 or 0)
        time.sleep(0.25)
    raise SystemExit(f"no {pattern.pattern!r} within {timeout:.0f} s; see {log_path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench_restart_")
    env = {"GRAMSYNC_COMPILE_CACHE_DIR": os.path.join(work, "compile"), "GRAMSYNC_TORCH_COMPILE_AUTO": "1"}
    common = f"--dtype {args.dtype} --max-total-tokens 8192 --log-level info"
    print(f"# {os.cpu_count()} cores ({cpu_flags()}); dtype {args.dtype}; "
          f"{args.streams} streams x {args.tokens} tokens", flush=True)
    try:
        with launched_server(free_port(), f"{common} --disable-torch-compile", env=env) as base:
            off_tok_s, off_wall = streams_tok_s(base, args.streams, args.tokens)
            off_ms, _ = per_token_ms(base, 64, 3)
        print(f"compile off: {off_tok_s:.1f} tok/s ({off_wall:.1f} s); batch 1 {off_ms:.1f} ms/token", flush=True)

        log = os.path.join(work, "first.log")
        t0 = time.monotonic()
        with launched_server(free_port(), common, env=env, log_path=log, start_timeout=300) as base:
            healthy = time.monotonic() - t0
            first_tok_s, first_wall = streams_tok_s(base, args.streams, args.tokens)
            wait_for(log, BUILT, 1800)
            built = time.monotonic() - t0
            load_tok_s, load_wall = streams_tok_s(base, args.streams, args.tokens)
            counts = wait_for(log, READY, 1800)
            first_ready = time.monotonic() - t0
        print(f"first start: healthy in {healthy:.1f} s; {first_tok_s:.1f} tok/s while the builder "
              f"compiles ({first_wall:.1f} s); builder done at {built:.1f} s; {load_tok_s:.1f} tok/s "
              f"while the rank loads its build ({load_wall:.1f} s); compiled steps ready at "
              f"{first_ready:.1f} s ({counts})", flush=True)

        log = os.path.join(work, "restart.log")
        t0 = time.monotonic()
        with launched_server(free_port(), common, env=env, log_path=log, start_timeout=300) as base:
            counts = wait_for(log, READY, 600)
            restart = time.monotonic() - t0
            on_ms, _ = per_token_ms(base, 64, 3)
        print(f"restart: {counts}; batch 1 {on_ms:.1f} ms/token")
        print(f"restart to compiled: {restart:.1f} s")
        print(f"vs compile off, tok/s: {first_tok_s / off_tok_s:.2f}x while the builder compiles, "
              f"{load_tok_s / off_tok_s:.2f}x while the rank loads the build; restarted compiled vs "
              f"compile off, batch 1: {on_ms / off_ms:.2f}x time per token")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
