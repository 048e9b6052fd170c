"""TP collectives on CPU: shared memory (the default) vs gloo, same run.

    .venv/bin/python benchmark/bench_tp_collectives.py [--tp 2 4] [--tokens 64] [--repeats 3]

1. The ops a decode step makes, timed on every rank of a spawned TP group (medians of 5
   rounds x 300 calls; the slowest rank's): the row-parallel all-reduce at 1, 16 and 256
   rows of SmolLM2's hidden size (576) and the logits all-gather at 1 row.
2. A real server (launch.py, embedded SmolLM2, --tp-size 2, fp32) per mode
   (GRAMSYNC_CPU_SHM_COLLECTIVES=1 and 0): one greedy request of --tokens tokens, the
   median time per token over --repeats requests, and whether both modes gave the same ids.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compile_pool import cpu_flags  # noqa: E402
from bench_serving import free_port, launched_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = [("all_reduce", (1, 576)), ("all_reduce", (16, 576)), ("all_reduce", (256, 576)),
       ("all_gather", (1, 24576))]


def _rank(rank: int, size: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from distributed.shm_collectives import create_shm_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    shm = create_shm_collectives(rank, size, dist.group.WORLD, 60)
    res = {}
    for op, shape in OPS:
        x = torch.randn(shape)
        parts = [torch.empty_like(x) for _ in range(size)]
        ways = {"gloo": (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: dist.all_gather(parts, x)),
                "shm": (lambda: shm.all_reduce(x)) if op == "all_reduce" else (lambda: shm.all_gather_last_dim(x))}
        for name, fn in ways.items():
            rounds = []
            for _ in range(6):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(300):
                    fn()
                rounds.append((time.perf_counter() - t) / 300)
            res[(op, shape, name)] = statistics.median(rounds[1:])
    out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def time_ops(size: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, out), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    return {k: max(r[k] for r in results) for k in results[0]}


def per_token_ms(base: str, tokens: int, repeats: int) -> tuple[float, list[int]]:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                            "ignore_eos": True}}
    times, ids = [], None
    for _ in range(repeats + 1):  # the first is a warm-up
        t = time.perf_counter()
        r = httpx.post(base + "/generate", json=body, timeout=600).json()
        times.append((time.perf_counter() - t) * 1000 / tokens)
        ids = r["output_ids"]
    return statistics.median(times[1:]), ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[2])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-server", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    print(f"# {os.cpu_count()} cores ({cpu_flags()}); fp32", flush=True)
    print("\n| TP | op | shape | gloo | shared memory | ratio |\n|---|---|---|---|---|---|")
    for size in args.tp:
        res = time_ops(size)
        for op, shape in OPS:
            g, s = res[(op, shape, "gloo")], res[(op, shape, "shm")]
            print(f"| {size} | {op} | {shape[0]}x{shape[1]} | {g * 1e6:.0f} us | {s * 1e6:.1f} us | {g / s:.0f}x |",
                  flush=True)
    if args.skip_server:
        return
    rows, ids = {}, {}
    for mode in ("1", "0"):
        os.environ["GRAMSYNC_CPU_SHM_COLLECTIVES"] = mode
        with launched_server(free_port(), "--tp-size 2 --dtype float32 --disable-torch-compile "
                                          "--max-total-tokens 4096 --log-level warning") as base:
            rows[mode], ids[mode] = per_token_ms(base, args.tokens, args.repeats)
    print(f"\ntp2 greedy decode: shared memory {rows['1']:.1f} ms/token, gloo {rows['0']:.1f} ms/token, "
          f"ratio {rows['0'] / rows['1']:.2f}x, same ids: {ids['1'] == ids['0']}")


if __name__ == "__main__":
    main()
