"""NCCL at TP=2 for ``make gpu-check``: two processes, one GPU each, all-reduce checked and
timed (a decode row, 1x4096 bf16, and a prefill chunk, 2048x4096 bf16). Prints NCCL-OK."""
from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out: dict) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=120))
    try:
        for rows in (1, 2048):
            x = torch.full((rows, 4096), rank + 1.0, dtype=torch.bfloat16, device="cuda")
            dist.all_reduce(x)
            if not bool((x == 3.0).all()):
                raise AssertionError(f"all_reduce of {rows} rows gave {x.flatten()[:4].tolist()}")
            times = []
            for _ in range(50):
                torch.cuda.synchronize()
                t = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            if rank == 0:
                out[rows] = 1e6 * statistics.median(times)
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, out), nprocs=2, join=True)
    print(f"NCCL-OK all_reduce 1x4096 bf16 {out[1]:.1f} us, 2048x4096 bf16 {out[2048]:.1f} us")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    main()
