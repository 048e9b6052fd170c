"""Shared-memory collectives for a CPU TP group whose ranks share one machine.

gloo's ``all_reduce`` of one decode row (576 fp32) takes ~1.9 ms between two processes on
loopback; a decode step of SmolLM2 makes 61 such calls (two per layer and the logits), so
at TP=2 on CPU the collectives cost more than the matmuls. Engines that serve TP on CPU
(vLLM's CPU backend, SGLang's, DeepSpeed) reduce through shared memory instead; no
library ships that for a plain torch CPU build, so here it is: ~10 us for the same call
(``benchmark/bench_tp_collectives.py``).

One segment per TP group: a flag per rank (the number of its last published operation)
and two buffers of one slot per rank. A rank copies its tensor into its slot of buffer
``k % 2``, publishes ``k``, waits until every rank has published ``k``, then combines the
slots in rank order, so every rank computes the same bits. Two buffers suffice: a rank
publishes ``k + 1`` only after it has read operation ``k``, so nobody overwrites a slot
that is still being read. Ordering relies on x86-64's stores becoming visible in program
order (the data before the flag), so other machines keep gloo.

Tensors larger than a slot, and every op on other machines, go through gloo as before
(``None`` / ``False`` from here). Results equal gloo's bit for bit at TP=2 (a + b either
way); at larger TP the fixed rank order is deterministic on every rank.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import tempfile
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SLOT_BYTES = 2 << 20  # per rank and buffer: a 2-rank group maps 8 MiB of /dev/shm
FLAG_STRIDE = 64  # one cache line per rank's flag
TOKEN_BYTES = 16
SPIN_CHECKS = 2000  # ~0.1 ms of polling before the wait starts to yield the core


def shm_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmCollectives:
    """All-reduce (sum, min) and last-dim all-gather for the ranks of one TP group."""

    def __init__(self, mm: mmap.mmap, rank: int, size: int, timeout_s: float) -> None:
        self.mm, self.rank, self.size, self.timeout_s = mm, rank, size, timeout_s
        header = FLAG_STRIDE * size
        self.flags = np.ndarray((size,), dtype=np.int64, buffer=mm, offset=0, strides=(FLAG_STRIDE,))
        self.slots = torch.frombuffer(mm, dtype=torch.uint8, offset=header,
                                      count=2 * size * SLOT_BYTES).view(2, size, SLOT_BYTES)
        self.others = [r for r in range(size) if r != rank]
        self.seq = 0  # a new segment's flags are all 0
        self._views: dict = {}

    # ---- operations ---------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> bool:
        """In place. False (nothing done) when ``x`` does not fit a slot."""
        parts = self._publish(x)
        if parts is None:
            return False
        if op == "sum":
            torch.add(parts[0], parts[1], out=x)
            for p in parts[2:]:
                x.add_(p)
        elif op == "min":
            torch.minimum(parts[0], parts[1], out=x)
            for p in parts[2:]:
                torch.minimum(x, p, out=x)
        else:
            raise ValueError(f"unsupported op {op!r}")
        return True

    def all_gather_last_dim(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Every rank's ``x`` concatenated along the last dim in rank order; None when it
        does not fit a slot."""
        parts = self._publish(x)
        return None if parts is None else torch.cat(parts, dim=-1)

    # ---- the protocol -------------------------------------------------------------------
    def _publish(self, x: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Copy ``x`` into this rank's slot, publish it, wait for every rank's; the slots'
        views (valid until this rank's next operation but one)."""
        views = self._slot_views(x)
        if views is None:
            return None
        k = self.seq = self.seq + 1
        parts = views[k & 1]
        parts[self.rank].copy_(x)
        self.flags[self.rank] = k  # after the data: x86 keeps the stores in this order
        for r in self.others:
            self._wait_for(r, k)
        return parts

    def _slot_views(self, x: torch.Tensor) -> Optional[list[list[torch.Tensor]]]:
        key = (tuple(x.shape), x.dtype)
        views = self._views.get(key)
        if views is None:
            nbytes = x.numel() * x.element_size()
            if nbytes > SLOT_BYTES or x.device.type != "cpu":
                return None
            views = [[self.slots[b, r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]
                     for b in (0, 1)]
            if len(self._views) < 256:  # decode shapes repeat; prefill chunk shapes vary
                self._views[key] = views
        return views

    def _wait_for(self, peer: int, k: int) -> None:
        """Spin briefly (peers arrive within microseconds in a step), then yield the core,
        then sleep: a rank waiting on a slow peer must not take the CPU it needs."""
        flags = self.flags
        checks = 0
        while flags[peer] < k:
            checks += 1
            if checks < SPIN_CHECKS:
                continue
            if checks == SPIN_CHECKS:
                start = time.monotonic()
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise RuntimeError(f"TP rank {peer} did not reach shared-memory collective {k} "
                                   f"within {self.timeout_s:.0f} s")
            if waited < 1e-3:
                os.sched_yield()
            else:
                time.sleep(50e-6)


def create_shm_collectives(tp_rank: int, tp_size: int, cpu_group, timeout_s: float,
                           wanted: bool = True, log_prefix: str = "") -> Optional[ShmCollectives]:
    """Collective over the TP group's gloo ``cpu_group`` (every rank calls it): TP rank 0
    makes a private segment (mode 600, unlinked once all have mapped it), the others map it
    and check a random token, and all agree. None on every rank when any rank cannot or
    does not want to (switched off, not x86-64, no shared memory, another machine): the
    group keeps gloo."""
    from distributed.broadcast import broadcast_pyobj

    src = dist.get_global_rank(cpu_group, 0)
    total = FLAG_STRIDE * tp_size + 2 * tp_size * SLOT_BYTES
    mm, path, problem = None, None, None
    if tp_rank == 0:
        mm, path, token, problem = (_make_segment(total) if wanted and shm_supported()
                                    else (None, None, b"", "switched off" if not wanted else "not x86-64"))
        offer = (path, token, os.getuid()) if mm is not None else None
    offer = broadcast_pyobj(offer if tp_rank == 0 else None, tp_rank == 0, src, cpu_group)
    if tp_rank != 0 and offer is not None and wanted:
        mm, problem = _map_segment(*offer, total)
    elif tp_rank != 0:
        problem = "switched off" if not wanted else "TP rank 0 made no segment"
    ok = torch.tensor([1 if mm is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if tp_rank == 0 and path is not None:
        os.unlink(path)  # every rank has mapped it (or given up): nothing stays on disk
    if not int(ok.item()):
        if mm is not None:
            mm.close()
        logger.info("%s TP collectives over gloo (%s)", log_prefix, problem or "another rank cannot share memory")
        return None
    logger.info("%s TP collectives through shared memory (%d MiB)", log_prefix, total >> 20)
    return ShmCollectives(mm, tp_rank, tp_size, timeout_s)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _make_segment(total: int):
    """(mmap, path, token, problem): a new file only we can open, its pages reserved (a
    full /dev/shm fails here, not with SIGBUS mid-step), a token at its end."""
    path = os.path.join(_shm_dir(), f"gramsync-tp-{secrets.token_hex(12)}")
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        return None, None, b"", f"cannot create {path}: {e}"
    try:
        os.posix_fallocate(fd, 0, total + TOKEN_BYTES)
        mm = mmap.mmap(fd, total + TOKEN_BYTES)
        mm[total:] = token
        return mm, path, token, None
    except OSError as e:
        os.unlink(path)
        return None, None, b"", f"cannot reserve {total >> 20} MiB in {_shm_dir()}: {e}"
    finally:
        os.close(fd)


def _map_segment(path: str, token: bytes, uid: int, total: int):
    """(mmap, problem): rank 0's segment, if this machine has it, it is ours and it holds
    rank 0's token."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        return None, f"no segment {path} on this machine ({e.strerror})"
    try:
        st = os.fstat(fd)
        if st.st_uid != uid or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != total + TOKEN_BYTES:
            return None, f"{path} is not rank 0's private segment"
        mm = mmap.mmap(fd, total + TOKEN_BYTES)
        if mm[total:] != token:
            mm.close()
            return None, f"{path} holds another token"
        return mm, None
    finally:
        os.close(fd)
