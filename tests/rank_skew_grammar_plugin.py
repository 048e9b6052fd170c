"""A third-party grammar backend for multi-rank tests, loaded with
``--grammar-backend-plugins rank_skew_grammar_plugin --grammar-backend rankskew``
(tests/ on PYTHONPATH): xgrammar, but each TP rank compiles on its own schedule, so the
ranks' grammar futures complete at different scheduler iterations and in different orders.

- Every compile first sleeps a random extra: 0-300 ms on rank 1, 0-50 ms on rank 0
  (each process seeds its own RNG from os.urandom, so the ranks really differ).
- A spec containing ``FAILONRANK1`` raises on rank 1 only (after its skew); rank 0
  compiles it normally. Put the marker in a regex branch, e.g. ``(FAILONRANK1|[a-z]+)``,
  or in a JSON schema's "description", so that xgrammar still accepts the spec.
- A spec containing ``SLOWRANK0`` sleeps an extra ``SLOW_RANK0_S`` on rank 0 (so that
  rank 1's verdict on the same spec comes first).
- A spec containing ``HANGONRANK1`` blocks its compile on rank 1 until a spec containing
  ``RELEASEHANG`` is compiled (by any later request), or at most ``HANG_S`` seconds, so it
  exceeds SGLANG_GRAMMAR_MAX_POLL_ITERATIONS there only.

With ``RANKSKEW_LOG_DIR`` set, every rank appends one line per compile to
``<dir>/rankskew_rank{r}.log``: ``<monotonic end time> <slept ms> <outcome> <spec sha1[:12]>``
(outcome: ok, fail, hang-released, hang-expired), so a test can check that the skew
really happened. CLOCK_MONOTONIC is system-wide on Linux: the ranks' times compare.
"""
from __future__ import annotations

import hashlib
import os
import random
import threading
import time

from constrained.registry import register_grammar_backend
from constrained.xgrammar_backend import XGrammarGrammarBackend

MAX_SKEW_S = {0: 0.05, 1: 0.3}  # per rank; other ranks: like rank 0
SLOW_RANK0_S = 1.0
HANG_S = 45.0


class InjectedCompileError(RuntimeError):
    pass


def _tp_rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001 - a single-process server is rank 0
        return 0


class RankSkewBackend(XGrammarGrammarBackend):
    name = "rankskew"

    def can_use_compile_pool(self) -> bool:
        return False  # its skew is per rank: each rank must compile on its own threads

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = _tp_rank()
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little") ^ os.getpid())
        self.rng_lock = threading.Lock()
        self.unhang = threading.Event()
        log_dir = os.environ.get("RANKSKEW_LOG_DIR")
        self.log_path = os.path.join(log_dir, f"rankskew_rank{self.rank}.log") if log_dir else None
        self.log_lock = threading.Lock()

    def _log(self, slept: float, outcome: str, spec: str) -> None:
        if self.log_path is None:
            return
        digest = hashlib.sha1(spec.encode()).hexdigest()[:12]
        with self.log_lock, open(self.log_path, "a") as f:
            f.write(f"{time.monotonic():.6f} {slept * 1000:.1f} {outcome} {digest}\n")

    def dispatch(self, key):
        _, spec = key
        if "RELEASEHANG" in spec:
            self.unhang.set()
        with self.rng_lock:
            slept = self.rng.uniform(0.0, MAX_SKEW_S.get(self.rank, MAX_SKEW_S[0]))
        if "SLOWRANK0" in spec and self.rank == 0:
            slept += SLOW_RANK0_S
        time.sleep(slept)
        outcome = "ok"
        if "HANGONRANK1" in spec and self.rank == 1:
            outcome = "hang-released" if self.unhang.wait(HANG_S) else "hang-expired"
        if "FAILONRANK1" in spec and self.rank == 1:
            self._log(slept, "fail", spec)
            raise InjectedCompileError(f"rankskew injected compile failure on rank {self.rank}")
        try:
            return super().dispatch(key)
        finally:
            self._log(slept, outcome, spec)


register_grammar_backend("rankskew", RankSkewBackend.from_tokenizer)
