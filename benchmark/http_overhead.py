"""What the HTTP path adds to each streamed token: a real server (launch.py, the same
model, dtype and flags as the in-process measurement) streams the same greedy requests
over POST /v1/completions; its time per output token, beside the in-process step at the
same batch size, gives the per-token overhead of everything outside the step (ZMQ, the
detokenizer, the frontend's event loop, uvicorn, SSE) and of the frontend's CPU use
stealing from the step on a small machine. The client is sse_client.py's blocking
socket, a thread per stream: its own CPU per token is small and printed ("client").

Used by bench_offline.py, which prints ``http overhead bs=<n> <ms> ms per token``:

    .venv/bin/python benchmark/bench_offline.py --breakdown 1,8 --http-overhead 1,8 --skip-throughput
"""
from __future__ import annotations

import json
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from bench_serving import free_port, launched_server
from sse_client import sse_events

STREAM_READ_TIMEOUT_S = 300


def _stream_one(base: str, prompt_ids: list[int], new_tokens: int) -> float:
    """One streamed greedy request; its seconds per output token after the first (the
    client's clock: first token chunk to last)."""
    body = {"model": "default", "prompt": prompt_ids, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    for data in sse_events(base + "/v1/completions", body, timeout=STREAM_READ_TIMEOUT_S):
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
    if tokens != new_tokens or first is None or first == last:
        raise RuntimeError(f"expected {new_tokens} streamed tokens, got {tokens}")
    return (last - first) / (tokens - 1)


def _round(base: str, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """The streams started together, a thread each (blocking sockets: sse_client.py)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _stream_one(base, p, new_tokens), prompts))


def _cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            t = p.cpu_times()
            out[name] = t.user + t.system
        except psutil.NoSuchProcess:
            out[name] = 0.0
    return out


def server_processes() -> dict[str, psutil.Process]:
    """The server's processes by title (``gramsync::frontend``, ``gramsync::scheduler_*``),
    and this one as "client" (the benchmark's own streams cost CPU on the same cores)."""
    procs = {}
    for p in psutil.process_iter(["cmdline"]):
        title = (p.info["cmdline"] or [""])[0]
        if title.startswith("gramsync::") and "grammar" not in title:
            procs[title.removeprefix("gramsync::")] = p
    procs["client"] = psutil.Process()
    return procs


def tpot_ms(base: str, prompts_ids: list[list[int]], sizes: list[int], new_tokens: int,
            repeats: int) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """Median time per output token (ms) of ``bs`` streams started together, per size; and
    each process's CPU time per decode step (ms) over those rounds."""
    out, cpu = {}, {}
    procs = server_processes()
    for bs in sizes:
        prompts = [prompts_ids[i % len(prompts_ids)] for i in range(bs)]
        _round(base, prompts, 8)  # warm-up: connections, this batch size's step
        before = _cpu_seconds(procs)
        runs = [t for _ in range(repeats) for t in _round(base, prompts, new_tokens)]
        after = _cpu_seconds(procs)
        out[bs] = 1e3 * statistics.median(runs)
        cpu[bs] = {k: 1e3 * (after[k] - before[k]) / (repeats * new_tokens) for k in procs}
    return out, cpu


def measure(model_dir: str, server_flags: list[str], prompts_ids: list[list[int]], sizes: list[int],
            new_tokens: int = 64, repeats: int = 3) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """Launch a server with ``server_flags`` (compiled steps waited for), measure, stop it."""
    flags = ["--model-path", model_dir, "--wait-for-torch-compile", "--log-level", "warning",
             "--max-running-requests", str(max(sizes)), *server_flags]
    with launched_server(free_port(), shlex.join(flags)) as base:
        return tpot_ms(base, prompts_ids, sizes, new_tokens, repeats)


def print_cpu(cpu: dict[int, dict[str, float]]) -> None:
    """Where the cores went per decode step: a scheduler rank near threads x step means its
    torch threads spin between kernels, so whatever else runs takes a core from them."""
    for bs, row in cpu.items():
        parts = "  ".join(f"{k} {v:.2f}" for k, v in row.items())
        print(f"cpu per step bs={bs} (ms): {parts}")


def print_overhead(http_ms: dict[int, float], step_ms: dict[int, float]) -> dict[int, float]:
    """The issue's lines (checks read them): HTTP time per token minus the in-process step."""
    overhead = {}
    for bs, ms in http_ms.items():
        if bs not in step_ms:
            continue
        overhead[bs] = ms - step_ms[bs]
        print(f"http bs={bs}: {ms:.2f} ms per token streamed, in-process step {step_ms[bs]:.2f} ms")
    for bs, ms in overhead.items():
        print(f"http overhead bs={bs} {ms:.2f} ms per token")
    return overhead
