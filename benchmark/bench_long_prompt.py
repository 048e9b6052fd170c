"""Do running decodes stall while a long prompt is prefilled? Chunked prefill vs none.

    .venv/bin/python benchmark/bench_long_prompt.py [--running 16] [--long-len 4000]
        [--server-args "--max-running-requests 32"] [--configs "default,-1"]

For each --chunked-prefill-size in --configs (``default`` leaves the flag out): start a
server, stream --running requests with long outputs, and once they all decode, send one
prompt of --long-len tokens. Prints the running requests' inter-token latency (median,
p90, p99, max) and the long request's time to first token, per config, in one table.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import free_port, launched_server, send  # noqa: E402
from serving_datasets import Request, filler_words  # noqa: E402


async def scenario(base: str, args) -> dict:
    rnd = random.Random(0)
    running = [Request(f"Story {i}: " + " ".join(filler_words(rnd, 60)), args.output_len) for i in range(args.running)]
    long_req = Request("Summarise these notes: " + " ".join(filler_words(rnd, args.long_len)), 8)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        url = base + "/generate"
        await send(client, url, Request("Warm-up.", 4), {})
        tasks = [asyncio.create_task(send(client, url, r, {})) for r in running]
        await asyncio.sleep(args.long_after)  # all of them decoding by then
        long_res = await send(client, url, long_req, {})
        long_ttft = long_res.ttft
        results = await asyncio.gather(*tasks)
    itls = np.asarray([x for r in results for x in r.itls]) * 1000
    return {"ok": all(r.ok for r in results) and long_res.ok, "long_prompt_tokens": long_res.prompt_tokens,
            "long_ttft_s": long_ttft, "itl_median_ms": float(np.median(itls)),
            "itl_p90_ms": float(np.percentile(itls, 90)), "itl_p99_ms": float(np.percentile(itls, 99)),
            "itl_max_ms": float(itls.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=16)
    p.add_argument("--output-len", type=int, default=160)
    p.add_argument("--long-len", type=int, default=4000)
    p.add_argument("--long-after", type=float, default=4.0, help="seconds before the long prompt")
    p.add_argument("--server-args", default="--max-running-requests 32")
    p.add_argument("--configs", default="default,-1", help="--chunked-prefill-size values")
    args = p.parse_args()
    rows = []
    for config in args.configs.split(","):
        extra = "" if config == "default" else f" --chunked-prefill-size {config}"
        with launched_server(free_port(), args.server_args + " --wait-for-torch-compile" + extra) as base:
            rows.append((config, asyncio.run(scenario(base, args))))
    print(f"\n{args.running} running decodes, one {args.long_len}-token prompt arriving "
          f"(--chunked-prefill-size; default = 256 on CPU)")
    print(f"{'chunk':>8}{'ok':>5}{'ITL p50':>9}{'p90':>8}{'p99':>8}{'max':>8}{'p99/p50':>9}{'long TTFT':>11}")
    for config, r in rows:
        print(f"{config:>8}{str(r['ok']):>5}{r['itl_median_ms']:>9.1f}{r['itl_p90_ms']:>8.1f}"
              f"{r['itl_p99_ms']:>8.1f}{r['itl_max_ms']:>8.0f}{r['itl_p99_ms'] / r['itl_median_ms']:>9.2f}"
              f"{r['long_ttft_s']:>10.2f}s")


if __name__ == "__main__":
    main()
