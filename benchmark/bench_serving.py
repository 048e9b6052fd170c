"""Online serving benchmark (after SGLang's bench_serving): latency and throughput of a
gramsync server under Poisson traffic, over the native streaming POST /generate.

    # against a server that is already up (make serve)
    .venv/bin/python benchmark/bench_serving.py --num-prompts 64 --request-rate 8
    # start a server on a free port, benchmark it, stop it
    .venv/bin/python benchmark/bench_serving.py --launch --server-args "--max-running-requests 8" \\
        --num-prompts 8 --input-len 64 --output-len 16 --request-rate 4
    # half the requests constrained by a JSON schema; all figures to a file
    .venv/bin/python benchmark/bench_serving.py --json-schema-share 0.5 --output-json out.json

    # the radix cache: 64 requests behind one 1,500-token system prompt; multi-turn chats
    .venv/bin/python benchmark/bench_serving.py --launch --dataset shared-prefix \
        --sp-system-len 1500 --sp-question-len 50 --num-prompts 64 --output-len 16
    .venv/bin/python benchmark/bench_serving.py --launch --dataset multi-turn --mt-turns 4

Prompts are built from fixed word lists (serving_datasets.py, no downloads): by default
they share only a few tokens of prefix, so the radix cache cannot flatter the figures.
--input-len counts approximate tokens; the table reports the server's exact counts and
how many prompt tokens came from the cache. Unconstrained requests set
ignore_eos, so each produces exactly its drawn output length; constrained ones stop when
their JSON document is complete (or at max_new_tokens).
"""
from __future__ import annotations

import argparse, asyncio, contextlib, json, os, random, shlex, signal, socket, subprocess, sys, tempfile, time
from dataclasses import asdict, dataclass, field
from typing import Optional
from urllib.parse import urlparse

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_datasets import Request, make_requests, multi_turn_question  # noqa: E402
@dataclass
class Result:
    constrained: bool
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itls: list = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""


def request_body(req: Request) -> dict:
    p = {"max_new_tokens": req.max_new_tokens, "temperature": 0}
    if req.schema is None:
        p["ignore_eos"] = True  # a fixed output length; a grammar instead ends its own document
    else:
        p["json_schema"] = json.dumps(req.schema)
    return {"text": req.prompt, "sampling_params": p, "stream": True}


async def send(client: httpx.AsyncClient, url: str, req: Request, headers: dict) -> Result:
    """One streamed request. Chunks are SSE `data: {...}` lines (cumulative text, meta_info)
    ending with `data: [DONE]`; an error after the first byte arrives as `{"error": ...}`."""
    res = Result(constrained=req.schema is not None)
    start = last = time.perf_counter()
    seen, finish = 0, None
    async with client.stream("POST", url, json=request_body(req), headers=headers) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
            return res
        async for line in resp.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else None
            if data == "[DONE]":
                break
            if not data:
                continue
            chunk, now = json.loads(data), time.perf_counter()
            if "error" in chunk:
                res.error = f"error event: {chunk['error'].get('message')}"
                return res
            meta = chunk["meta_info"]
            n = meta["completion_tokens"]
            if n > seen:
                if seen == 0:
                    res.ttft = now - start  # other tokens of this first chunk get no ITL
                else:  # the server coalesces when behind: a chunk's k tokens share its gap evenly
                    res.itls += [(now - last) / (n - seen)] * (n - seen)
                seen, last = n, now
            res.prompt_tokens, res.output_tokens, res.text = meta["prompt_tokens"], n, chunk["text"]
            res.cached_tokens = meta.get("cached_tokens", 0)
            finish = meta["finish_reason"] or finish
    res.latency = time.perf_counter() - start
    if finish is None or finish.get("type") == "abort":  # an abort is a normal-looking last chunk
        res.error = f"aborted: {finish.get('message')}" if finish else "stream ended without a finish reason"
    res.ok = not res.error
    return res


async def run_benchmark(args, base_url: str, reqs: list[Request]) -> tuple[list[Result], float, dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    n, rate = len(reqs), args.request_rate
    # Poisson process: exponential gaps between arrivals, the first at 0.
    rng = np.random.default_rng(args.seed + 1)
    gaps = np.zeros(n) if rate == float("inf") else rng.exponential(1 / rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    flight = {"now": 0, "peak": 0, "busy_s": 0.0}
    # No connection cap: httpx's default pool (100) would silently cap the concurrency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        url = base_url + "/generate"

        async def guarded(req: Request) -> Result:  # a failure is a result, never an exception
            try:
                return await asyncio.wait_for(send(client, url, req, headers), args.request_timeout)
            except asyncio.TimeoutError:
                return Result(req.schema is not None, error=f"timed out after {args.request_timeout} s")
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                return Result(req.schema is not None, error=f"{type(e).__name__}: {e}")

        # Warm-up keeps first-request costs out of the figures; its own first word keeps it
        # from sharing a cached prefix with the first benchmark prompt.
        for _ in range(args.warmup_requests):
            warm = await guarded(Request("Warm-up: " + reqs[0].prompt, reqs[0].max_new_tokens))
            if not warm.ok:
                print("warm-up request failed:", warm.error, flush=True)

        async def one(req: Request, at: float) -> Result:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with sem:
                flight["now"] += 1
                flight["peak"] = max(flight["peak"], flight["now"])
                began = time.perf_counter()
                try:
                    return await guarded(req)
                finally:
                    flight["now"] -= 1
                    flight["busy_s"] += time.perf_counter() - began

        async def conversation(first: Request, at: float) -> list[Result]:
            """Turns in order; each resends the history with the model's own answers."""
            rnd, req, out = random.Random(args.seed * 1000 + first.conversation), first, []
            for turn in range(args.mt_turns):
                out.append(await one(req, at if turn == 0 else 0.0))
                req = Request(f"{req.prompt} {out[-1].text}\n{multi_turn_question(rnd, turn + 1)}",
                              first.max_new_tokens, conversation=first.conversation)
            return out

        t0 = time.perf_counter()
        if args.dataset == "multi-turn":
            convs = await asyncio.gather(*(conversation(r, a) for r, a in zip(reqs, arrivals)))
            results = [res for conv in convs for res in conv]
        else:
            results = await asyncio.gather(*(one(r, a) for r, a in zip(reqs, arrivals)))
        return results, time.perf_counter() - t0, flight


def dist(name: str, seconds: list) -> dict:
    """Mean, median, p90 and p99 of some durations, in ms."""
    ms = np.asarray(seconds, dtype=float) * 1000
    vals = [ms.mean(), *np.percentile(ms, [50, 90, 99])] if len(ms) else [float("nan")] * 4
    return {f"{s}_{name}_ms": float(v) for s, v in zip(("mean", "median", "p90", "p99"), vals)}


def summarize(results: list[Result], duration: float, flight: dict) -> dict:
    ok = [r for r in results if r.ok]
    cons = [r for r in ok if r.constrained]
    tokens_in, tokens_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": tokens_in, "total_output_tokens": tokens_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_share": sum(r.cached_tokens for r in ok) / max(tokens_in, 1),
        "request_throughput": len(ok) / duration,
        "input_throughput": tokens_in / duration, "output_throughput": tokens_out / duration,
        **dist("ttft", [r.ttft for r in ok]),
        **dist("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        **dist("itl", [x for r in ok for x in r.itls]),
        **dist("e2e_latency", [r.latency for r in ok]),
        "peak_in_flight": flight["peak"],
        "mean_in_flight": flight["busy_s"] / duration,  # time-averaged (Little's law)
        "constrained_requests": len(cons),
        "constrained_valid_json": sum(is_json_object(r.text) for r in cons),
    }


def is_json_object(text: str) -> bool:
    with contextlib.suppress(ValueError):
        return isinstance(json.loads(text), dict)
    return False


def label(key: str) -> str:
    """mean_ttft_ms -> "Mean TTFT (ms)"."""
    s = "_".join(w.upper() if w in ("ttft", "tpot", "itl", "e2e", "json") else w for w in key.split("_"))
    for suffix, unit in (("_ms", " (ms)"), ("_s", " (s)"), ("put_throughput", "put_throughput (tok/s)"),
                         ("request_throughput", "request_throughput (req/s)")):
        if s.endswith(suffix):
            s = s[:-len(suffix)] + unit
            break
    return s[0].upper() + s[1:].replace("_", " ")


def print_table(args, metrics: dict, info: Optional[dict]) -> None:
    print("{:=^60}".format(" Serving Benchmark Result "))
    keys = ("model_path", "tp_size", "dp_size", "max_running_requests", "max_total_num_tokens",
            "context_len", "grammar_backend")
    rows = [(f"Server {k}", info[k]) for k in keys if k in (info or {})]
    rows += [("Traffic request rate", args.request_rate),
             ("Max concurrency (limit)", args.max_concurrency or "-")]
    for name, v in rows + [(label(k), v) for k, v in metrics.items()]:
        print(f"{name + ':':<44}{v:.2f}" if isinstance(v, float) else f"{name + ':':<44}{v}")
    print("=" * 60)


async def server_info(base_url: str, api_key: Optional[str]) -> Optional[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with contextlib.suppress(httpx.HTTPError, ValueError):
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.get(base_url + "/get_server_info", headers=headers)
            if r.status_code == 200:  # 401/403: an admin key guards it; the benchmark goes on
                return r.json()
    return None


@contextlib.contextmanager
def launched_server(port: int, server_args: str, start_timeout: float = 900.0, env: dict | None = None,
                    log_path: str | None = None):
    """Start launch.py in its own process group; always stop it (SIGTERM, then SIGKILL).
    ``start_timeout``: seconds to become healthy (--wait-for-torch-compile takes minutes);
    ``env``: added to the server's environment; ``log_path``: keep its output there."""
    python = os.path.join(REPO, ".venv", "bin", "python")
    cmd = [python if os.path.exists(python) else sys.executable, "launch.py", "--port", str(port),
           *shlex.split(server_args)]
    log = (open(log_path, "w") if log_path else
           tempfile.NamedTemporaryFile("w", prefix="bench_serving_server_", suffix=".log", delete=False))
    print(f"launching: {shlex.join(cmd)} (log: {log.name})", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.time() + start_timeout
        while not _healthy(port):
            if proc.poll() is not None or time.time() > deadline:
                with open(log.name, errors="replace") as f:
                    tail = "".join(f.readlines()[-30:])
                raise SystemExit(f"server not up (exit code {proc.poll()}); last log lines:\n{tail}")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
        if not log_path:
            os.unlink(log.name)  # kept only when something went wrong
    finally:
        proc.terminate()  # the launcher stops its scheduler ranks itself
        grace = time.time() + 20
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while time.time() < grace:  # ProcessLookupError once its whole group is gone
                proc.poll()
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left after the grace period
        proc.wait()


def _healthy(port: int) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="default http://127.0.0.1:30000; with --launch, a free port")
    p.add_argument("--api-key", default=os.environ.get("GRAMSYNC_API_KEY"), help="sent as a Bearer token")
    p.add_argument("--launch", action="store_true", help="start launch.py here, stop it at the end")
    p.add_argument("--launch-timeout", type=float, default=900.0,
                   help="--launch: seconds the server may take to start (compiling takes minutes)")
    p.add_argument("--server-args", default="", help='flags for launch.py, e.g. "--max-running-requests 8"')
    p.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "multi-turn"],
                   help="prompt shapes (serving_datasets.py)")
    p.add_argument("--sp-system-len", type=int, default=1500, help="shared-prefix: system prompt tokens")
    p.add_argument("--sp-question-len", type=int, default=50, help="shared-prefix: question tokens")
    p.add_argument("--mt-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (multi-turn: conversations)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); inf: at once")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=128, help="most prompt tokens (approximate)")
    p.add_argument("--output-len", type=int, default=128, help="most max_new_tokens")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths are uniform in [ratio*len, len]")
    p.add_argument("--json-schema-share", type=float, default=0.0, help="share with a json_schema")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-json", help="write the args, figures and per-request results here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or not 0 <= args.json_schema_share <= 1:
        p.error("--num-prompts must be >= 1 and --json-schema-share in [0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    reqs = make_requests(args)
    with contextlib.ExitStack() as stack:
        if args.launch:
            port = (urlparse(args.base_url).port if args.base_url else None) or free_port()
            base_url = stack.enter_context(launched_server(port, args.server_args, args.launch_timeout))
        else:
            base_url = (args.base_url or "http://127.0.0.1:30000").rstrip("/")
        info = asyncio.run(server_info(base_url, args.api_key))
        results, duration, flight = asyncio.run(run_benchmark(args, base_url, reqs))
    metrics = summarize(results, duration, flight)
    print_table(args, metrics, info)
    for error in [r.error for r in results if not r.ok][:5]:
        print("error:", error)
    if args.output_json:
        per_request = [{k: v for k, v in asdict(r).items() if k != "itls"} for r in results]
        out = {"args": vars(args), "metrics": metrics, "server_info": info, "requests": per_request}
        with open(args.output_json, "w") as f:
            json.dump(_finite(out), f, indent=2)


def _finite(x):
    """inf and nan are not JSON: "inf" (a request rate) and null (no samples) instead."""
    if isinstance(x, float) and not np.isfinite(x):
        return None if np.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return [_finite(v) for v in x] if isinstance(x, list) else x


if __name__ == "__main__":
    main()
