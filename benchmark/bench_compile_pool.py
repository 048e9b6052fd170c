"""CPU seconds spent compiling a batch of distinct JSON schemas, per node, at TP=1 and TP=2:
the node's compile pool (srt/grammar_pool, compiled once per node) against the in-rank
threads every rank used before (each rank compiles its own copy).

    .venv/bin/python benchmark/bench_compile_pool.py            # 24 corpus schemas, 3 runs
    .venv/bin/python benchmark/bench_compile_pool.py --schemas 80 --runs 5 --backend auto

The pool side is the real service and real worker processes; each TP rank is represented
by what a rank runs for it: a ``CompilePoolClient`` (its submits, and its loader thread that
rebuilds every result into a grammar object). CPU = the service's and workers' CPU time
(psutil, after a warm-up compile) + each rank's load CPU. The thread side
calls ``init_value`` once per rank (what each rank's compile thread did). Ratios within one
run only; the figures depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from constrained.registry import create_grammar_backend  # noqa: E402
from srt.grammar_pool.client import CompilePoolClient  # noqa: E402
from srt.grammar_pool.private_dir import new_pool_dir, pool_socket_address  # noqa: E402
from srt.grammar_pool.service import STOP_SIGNAL, PoolConfig, start_pool_service  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402

VOCAB, EOS = 49152, (2,)


def corpus_keys(n: int, salt: str) -> list[tuple[str, str]]:
    """n distinct json_schema keys; ``salt`` makes them new to any cache."""
    with open(os.path.join(REPO, "benchmark", "data", "schema_corpus.json")) as f:
        schemas = json.load(f)["schemas"]
    keys = []
    for i in range(n):
        schema = dict(schemas[i % len(schemas)]["schema"], title=f"{salt}-{i}")
        keys.append(("json_schema", json.dumps(schema)))
    return keys


def tree_cpu(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def pool_cpu(args, backend, ranks: int, keys) -> float:
    directory = new_pool_dir()
    address = pool_socket_address(directory)
    service = start_pool_service(PoolConfig(args, VOCAB, EOS, 0, directory, address, 2, 600.0))
    try:
        clients = [CompilePoolClient(address, f"[TP{r}]") for r in range(ranks)]
        clients[0].submit(("regex", "warm[0-9]"), backend).result(300)  # the pool is up
        proc = psutil.Process(service.pid)
        before = tree_cpu(proc)
        loads = [c.load_cpu_seconds for c in clients]
        futures = [c.submit(k, backend) for k in keys for c in clients]
        for f in futures:
            f.result(600)
        return tree_cpu(proc) - before + sum(c.load_cpu_seconds - b for c, b in zip(clients, loads))
    finally:
        service.send_signal(STOP_SIGNAL)  # it removes its socket directory
        service.wait(10)


def thread_cpu(backend, ranks: int, keys) -> float:
    start = time.process_time()
    for _ in range(ranks):
        for k in keys:
            backend.init_value(k)
    return time.process_time() - start


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
        return " ".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags)
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemas", type=int, default=24)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", default="xgrammar", help="--grammar-backend of the ranks")
    a = p.parse_args()
    from srt.model_executor.model_loader import resolve_model_path
    from transformers import AutoTokenizer

    model = resolve_model_path(None)
    args = ServerArgs(model_path=model, grammar_backend=a.backend, log_level="warning")
    backend = create_grammar_backend(args, AutoTokenizer.from_pretrained(model), VOCAB, EOS)
    print(f"# {a.schemas} distinct corpus schemas, backend {a.backend}, {os.cpu_count()} cores "
          f"({cpu_flags()}); CPU seconds per batch, median of {a.runs} runs", flush=True)
    rows = {}
    for name, fn, ranks in [("pool TP=1", pool_cpu, 1), ("pool TP=2", pool_cpu, 2),
                            ("threads TP=1 (before)", thread_cpu, 1), ("threads TP=2 (before)", thread_cpu, 2)]:
        runs = []
        for r in range(a.runs):
            keys = corpus_keys(a.schemas, f"{name}-{r}-{uuid.uuid4().hex[:6]}")
            runs.append(fn(args, backend, ranks, keys) if fn is pool_cpu else fn(backend, ranks, keys))
            print(f"{name:24s} run {r}: {runs[-1]:.2f} s", flush=True)
        rows[name] = statistics.median(runs)
    print("\n| compiles on | CPU s at TP=1 | CPU s at TP=2 | TP=2 / TP=1 |\n|---|---|---|---|")
    for side in ("pool", "threads"):
        one = rows[f"{side} TP=1" + ("" if side == "pool" else " (before)")]
        two = rows[f"{side} TP=2" + ("" if side == "pool" else " (before)")]
        print(f"| {side} | {one:.2f} | {two:.2f} | {two / one:.2f}x |")


if __name__ == "__main__":
    main()
