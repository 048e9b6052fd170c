"""Does a long grammar compile slow down the requests that are decoding?

    .venv/bin/python benchmark/bench_compile_interference.py               # 8 streams, pool vs threads
    .venv/bin/python benchmark/bench_compile_interference.py --streams 16 --output-len 300

For each mode a server is launched (launch.py, embedded SmolLM2, --disable-torch-compile):
"pool" is the default (grammars compile in the node's compile pool at the lowest CPU
priority), "threads" is GRAMSYNC_GRAMMAR_COMPILE_WORKERS=0 (each rank compiles on its own
threads, as before issue 17). In each, --streams streaming requests (ignore_eos,
--output-len tokens) run twice: alone, and with one json_schema request sent a second in
whose compile is slow (six strings with distinct maxLength bounds: ~9 s of xgrammar on
these machines, ~400 MB exported). The table gives the median and p99 inter-token latency
of the streams over the whole run (medians over --repeats alternated pairs), the ratio
with/without the compile, and how the slow request ended. Compare rows of one run only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compile_pool import cpu_flags  # noqa: E402
from bench_serving import Request, free_port, launched_server, send  # noqa: E402

# ~9 s for xgrammar 0.2.9 (which compiles long maxLengths in milliseconds).
SLOW = {"type": "object", "required": [f"p{i}" for i in range(300)],
        "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i + 1}}}$"} for i in range(300)}}


async def one_run(base: str, args, with_compile: bool, salt: str) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=limits) as client:
        reqs = [Request(f"Stream {salt} {i}: tell a long story about the sea.", args.output_len)
                for i in range(args.streams)]
        streams = [asyncio.create_task(send(client, base + "/generate", r, {})) for r in reqs]
        slow = None
        if with_compile:
            await asyncio.sleep(1.0)  # the streams are decoding
            schema = dict(SLOW, title=salt)  # new to every cache
            body = {"text": "A record:", "sampling_params": {"json_schema": json.dumps(schema),
                                                              "max_new_tokens": 4, "temperature": 0}}
            t0 = time.perf_counter()
            slow = asyncio.create_task(client.post(base + "/generate", json=body))
        results = await asyncio.gather(*streams)
        slow_status = ""
        if slow is not None:
            resp = await slow
            text = resp.json().get("error", {}).get("message", "")[:90] if resp.status_code != 200 else "ok"
            slow_status = f"HTTP {resp.status_code} after {time.perf_counter() - t0:.1f} s: {text}"
    itls = np.array([x for r in results for x in r.itls]) * 1000
    failed = [r.error for r in results if not r.ok]
    return {"median": float(np.median(itls)), "p99": float(np.percentile(itls, 99)),
            "failed": len(failed), "slow": slow_status}


def merged(runs: list[dict]) -> dict:
    """Medians over repeats; the slow request's outcomes listed."""
    return {"median": float(np.median([r["median"] for r in runs])),
            "p99": float(np.median([r["p99"] for r in runs])),
            "slow": "; ".join(r["slow"] for r in runs if r["slow"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--output-len", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="pool,threads")
    # xgrammar: the slow schema's compile is xgrammar's (auto would serve it with llguidance in ms).
    p.add_argument("--server-args", default="--disable-torch-compile --max-running-requests 16 "
                                            "--grammar-backend xgrammar")
    args = p.parse_args()
    print(f"# {args.streams} streams x {args.output_len} tokens; {os.cpu_count()} cores ({cpu_flags()})",
          flush=True)
    rows = []
    for mode in args.modes.split(","):
        os.environ["GRAMSYNC_GRAMMAR_COMPILE_WORKERS"] = "0" if mode == "threads" else "2"
        with launched_server(free_port(), args.server_args) as base:
            asyncio.run(one_run(base, args, False, f"warm-{mode}"))  # warm-up
            alones, busies = [], []
            for r in range(args.repeats):  # alternated, so drift hits both alike
                alones.append(asyncio.run(one_run(base, args, False, f"alone-{mode}-{r}")))
                busies.append(asyncio.run(one_run(base, args, True, f"busy-{mode}-{r}-{time.time()}")))
                print(mode, r, "alone", alones[-1], "\n", mode, r, "with compile", busies[-1], flush=True)
            rows.append((mode, merged(alones), merged(busies)))
    print("\n| compiles on | ITL median alone | with compile | ratio | ITL p99 alone | with compile "
          "| ratio | slow request |\n|---|---|---|---|---|---|---|---|")
    for mode, a, b in rows:
        print(f"| {mode} | {a['median']:.1f} ms | {b['median']:.1f} ms | {b['median'] / a['median']:.2f}x "
              f"| {a['p99']:.1f} ms | {b['p99']:.1f} ms | {b['p99'] / a['p99']:.2f}x | {b['slow']} |")


if __name__ == "__main__":
    main()
