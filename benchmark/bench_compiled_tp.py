"""Compiled steps at TP > 1 against the eager steps, same run, real servers.

    .venv/bin/python benchmark/bench_compiled_tp.py [--tp 2] [--dtype auto] [--tokens 64]

One ``--tp-size N`` server per mode, one after the other (embedded SmolLM2, shared-memory
collectives, the default): eager (``--disable-torch-compile``) and compiled
(``--enable-torch-compile --wait-for-torch-compile``: measured after every rank switched).
For each: batch 1, the median time per token of one greedy request of --tokens tokens over
--repeats requests (after one warm-up), and batch 8, output tokens/s of 8 such requests sent
together. Prints one line per mode, the ratios, and whether both modes gave the same ids
(fp32: they should; bf16 rounds differently between compiled and eager).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compile_pool import cpu_flags  # noqa: E402
from bench_serving import free_port, launched_server  # noqa: E402
from bench_tp_collectives import per_token_ms  # noqa: E402

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "1, 2, 3, 4,", "The quick brown fox", "In 1905, Einstein", "A recipe for bread:"]


def batch_tok_s(base: str, tokens: int) -> float:
    def one(text: str) -> int:
        body = {"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        return len(httpx.post(base + "/generate", json=body, timeout=900).json()["output_ids"])

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        list(pool.map(one, PROMPTS))  # warm-up: every batch size on the way down
        t = time.perf_counter()
        n = sum(pool.map(one, PROMPTS))
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"# {os.cpu_count()} cores ({cpu_flags()}); dtype {args.dtype}; tp {args.tp}", flush=True)
    rows = {}
    for mode, flags in (("eager", "--disable-torch-compile"),
                        ("compiled", "--enable-torch-compile --wait-for-torch-compile")):
        t = time.monotonic()
        with launched_server(free_port(), f"--tp-size {args.tp} --dtype {args.dtype} {flags} "
                                          "--max-total-tokens 8192 --log-level warning", start_timeout=1500) as base:
            started = time.monotonic() - t
            ms, ids = per_token_ms(base, args.tokens, args.repeats)
            rows[mode] = (ms, batch_tok_s(base, args.tokens), ids)
        print(f"tp{args.tp} {mode:<8} start {started:6.0f} s  batch-1 {ms:6.1f} ms/token  "
              f"batch-8 {rows[mode][1]:6.1f} tok/s", flush=True)
    (e_ms, e_tps, e_ids), (c_ms, c_tps, c_ids) = rows["eager"], rows["compiled"]
    print(f"tp{args.tp} compiled vs eager: batch-1 time per token ratio {c_ms / e_ms:.2f}x, "
          f"batch-8 tokens/s ratio {c_tps / e_tps:.2f}x, same ids: {c_ids == e_ids}")


if __name__ == "__main__":
    main()
