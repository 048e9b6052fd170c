"""Does a huge request slow its neighbours? A small chat request's latency, idle and beside
clients that keep sending a chat request with a 10 MB ``tools`` list (issue 32, item 5).

    .venv/bin/python benchmark/bench_large_request.py [--tools-mb 10] [--rounds 20]
        [--server-args "--disable-torch-compile"]

The large requests are refused (their prompt cannot fit the context), but only after their
body is parsed, validated, and their tools rendered and counted: all of it must happen off
the event loop. Prints the small request's median and p90 latency in both phases and the
ratio (target: <= 2x idle), with the large requests' own latency and status codes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import free_port, launched_server  # noqa: E402

SMALL = {"model": "default", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1,
         "temperature": 0}


def large_body(megabytes: float) -> bytes:
    tool = {"type": "function", "function": {"name": "f", "description": "x" * 900, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    n = int(megabytes * 1024 * 1024 / len(json.dumps(tool)))
    tools = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(n)]
    return json.dumps({**SMALL, "tools": tools}).encode()


def small_latencies(base: str, rounds: int) -> list[float]:
    out = []
    with httpx.Client(timeout=120) as c:
        for _ in range(rounds):
            t = time.perf_counter()
            assert c.post(base + "/v1/chat/completions", json=SMALL).status_code == 200
            out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools-mb", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--senders", type=int, default=1, help="clients sending large requests back to back")
    p.add_argument("--server-args", default="--disable-torch-compile")
    args = p.parse_args()
    body = large_body(args.tools_mb)
    with launched_server(free_port(), args.server_args) as base:
        small_latencies(base, 3)  # warm-up
        idle = small_latencies(base, args.rounds)
        stop, large, codes = threading.Event(), [], []

        def send_large() -> None:
            with httpx.Client(timeout=300) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    r = c.post(base + "/v1/chat/completions", content=body,
                               headers={"content-type": "application/json"})
                    large.append(time.perf_counter() - t)
                    codes.append(r.status_code)

        senders = [threading.Thread(target=send_large) for _ in range(args.senders)]
        for s in senders:
            s.start()
        time.sleep(1.0)  # the large requests are in flight
        busy = small_latencies(base, args.rounds)
        stop.set()
        for s in senders:
            s.join()
    med_idle, med_busy = statistics.median(idle), statistics.median(busy)
    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; "
          f"large body {len(body) / 1e6:.1f} MB, {len(large)} sent, status {sorted(set(codes))}, "
          f"median {statistics.median(large) * 1000:.0f} ms")
    print(f"small request idle: median {med_idle * 1000:.1f} ms, p90 {p90(idle) * 1000:.1f} ms")
    print(f"small request beside large: median {med_busy * 1000:.1f} ms, p90 {p90(busy) * 1000:.1f} ms")
    print(f"large-request ratio {med_busy / med_idle:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
