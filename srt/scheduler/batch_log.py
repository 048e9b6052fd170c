"""Optional per-rank record of every batch a scheduler runs (GRAMSYNC_BATCH_LOG_DIR).

One line per batch: ``<step> <mode> <rid>,<rid>,...``, written to
``<dir>/batches_DP{d}_TP{t}.log``; after a batch whose sampled ids went through the token
agreement (TP > 1, grammars in the batch), a line ``<step> AGREE <mismatches>``: how many
of this rank's own samples differed from the agreed ids (expected: always 0); after a
batch whose grammars forced tokens, ``<step> FORCED <row>:<token>,...``; with the
compiled steps at TP > 1, once, before the first batch that may use them, ``<step> COMPILED
decode=<0|1> prefill=<0|1>``: the step every rank switched in, and which compiled steps
it uses (0: stays eager); with the
radix cache on, ``<step> CACHE <digest> <evicted>`` after every batch: a hash of the whole
prefix tree (keys, slots, locks) once the batch's requests were cached or released, and
the tokens evicted so far; for a mixture-of-experts model, ``<step> ROUTING <digest>``
after each step that ran eagerly: a hash of every expert choice of every MoE layer
(srt/layers/moe/routing_digest.py). The ranks of a TP group must write identical files:
comparing them is how lock-step is checked (the multi-rank tests do) and how a
divergence is found in production.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, TextIO

from distributed.parallel_state import RankInfo
from srt import environ


class BatchLog:
    def __init__(self, path: Optional[str]):
        self.path = path
        self._file: Optional[TextIO] = open(path, "a", buffering=1) if path else None
        self._step = 0

    @classmethod
    def from_env(cls, rank_info: RankInfo) -> "BatchLog":
        directory = environ.GRAMSYNC_BATCH_LOG_DIR.get()
        if not directory:
            return cls(None)
        os.makedirs(directory, exist_ok=True)
        return cls(os.path.join(directory, f"batches_{rank_info.name}.log"))

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def record(self, mode: str, rids) -> None:
        if self._file is not None:
            self._file.write(f"{self._step} {mode} {','.join(rids)}\n")
            self._step += 1

    def record_forced(self, rows: list[int], ids: list[int]) -> None:
        """Tokens grammar fast-forward appended after this batch: ``row:token`` pairs."""
        if self._file is not None:
            pairs = ",".join(f"{r}:{t}" for r, t in zip(rows, ids))
            self._file.write(f"{self._step - 1} FORCED {pairs}\n")

    def record_verified(self, tokens: list[list[int]]) -> None:
        """Speculative decoding: each request's tokens taken this step (drafts kept, then
        one sampled), ``row:tok.tok`` pairs."""
        if self._file is not None:
            runs = ",".join(f"{r}:{'.'.join(map(str, t))}" for r, t in enumerate(tokens))
            self._file.write(f"{self._step - 1} VERIFIED {runs}\n")

    def record_agreement(self, mismatches: int) -> None:
        if self._file is not None:
            self._file.write(f"{self._step - 1} AGREE {mismatches}\n")

    def record_compiled(self, decode: bool, prefill: bool) -> None:
        if self._file is not None:
            self._file.write(f"{self._step} COMPILED decode={int(decode)} prefill={int(prefill)}\n")

    def record_routing(self, digest: Optional[str]) -> None:
        """The experts this step's tokens went to (None: the step ran compiled)."""
        if self._file is not None and digest is not None:
            self._file.write(f"{self._step - 1} ROUTING {digest}\n")

    def record_cache(self, digest: Callable[[], str], evicted: int) -> None:
        """``digest`` is only computed when the log is on (it walks the whole tree)."""
        if self._file is not None:
            self._file.write(f"{self._step - 1} CACHE {digest()} {evicted}\n")
