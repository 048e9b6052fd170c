"""Cumulative grammar counters of one rank, for ``--enable-metrics``.

One ``GrammarMetrics`` lives on each grammar backend (``backend.metrics``; a wrapping
backend shares its inner one's) and is also what the ``GrammarManager`` counts into. Compiles
and ``auto`` fallbacks are counted on the compile threads, the rest on the scheduler
thread: every update takes the lock, so ``snapshot()`` is consistent. Nothing here decides
anything the ranks must agree on; only the entry rank's counters are ever sent (to the
frontend, ``srt/metrics``), and the other ranks of its TP group compile the same grammars.
"""
from __future__ import annotations

import bisect
import re
import threading
from dataclasses import dataclass

# Seconds. llguidance compiles in ~1 ms, xgrammar in ~60 ms at p50 and >10 s at its tail.
COMPILE_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                   10.0, 20.0, 30.0, 60.0, 120.0, 240.0)
# One gloo all_reduce on loopback is ~0.5 ms; the slow path (all_gather_object) a few ms.
AGREEMENT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5)


class Buckets:
    """A cumulative histogram: per-bucket counts (the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le semantics
        self.sum += value

    def freeze(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        return self.bounds, tuple(self.counts), self.sum


@dataclass(frozen=True)
class GrammarMetricsSnapshot:
    """Plain values (``srt.metrics`` turns them into a wire message)."""

    compile_seconds: dict  # (backend, kind) -> (bounds, counts, sum)
    compile_failures: dict  # (backend, kind) -> count
    auto_fallbacks: dict  # (reason, outcome) -> count
    cache_hits: int
    cache_misses: int
    timeouts: int
    aborted: int
    agreement_seconds: tuple  # (bounds, counts, sum)


class GrammarMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compile: dict[tuple[str, str], Buckets] = {}
        self._failures: dict[tuple[str, str], int] = {}
        self._fallbacks: dict[tuple[str, str], int] = {}
        self._agreement = Buckets(AGREEMENT_BUCKETS)
        self.cache_hits = self.cache_misses = self.timeouts = self.aborted = 0

    def observe_compile(self, dispatch_type: str, kind: str, seconds: float, failed: bool) -> None:
        """One finished compile. ``dispatch_type`` is GrammarStats.dispatch_type: its first
        word names the engine that compiled it ("llguidance (fallback: ...)")."""
        key = (dispatch_type.split(" ", 1)[0] or "unknown", kind)
        with self._lock:
            self._compile.setdefault(key, Buckets(COMPILE_BUCKETS)).observe(seconds)
            if failed:
                self._failures[key] = self._failures.get(key, 0) + 1

    def count_fallback(self, reason: str, outcome: str) -> None:
        """``auto`` sent a spec past plain xgrammar; ``reason`` is a short fixed label."""
        with self._lock:
            self._fallbacks[(reason, outcome)] = self._fallbacks.get((reason, outcome), 0) + 1

    def count(self, field: str, n: int = 1) -> None:
        """cache_hits, cache_misses, timeouts or aborted."""
        with self._lock:
            setattr(self, field, getattr(self, field) + n)

    def observe_agreement(self, seconds: float) -> None:
        with self._lock:
            self._agreement.observe(seconds)

    def snapshot(self) -> GrammarMetricsSnapshot:
        with self._lock:
            return GrammarMetricsSnapshot(
                {k: b.freeze() for k, b in self._compile.items()}, dict(self._failures),
                dict(self._fallbacks), self.cache_hits, self.cache_misses, self.timeouts,
                self.aborted, self._agreement.freeze())


def fallback_label(reason: str) -> str:
    """A bounded label for why ``auto`` left its first choice (never user text: the
    xgrammar error message goes to logs and GrammarStats, not into a label)."""
    if reason.startswith("xgrammar rejected"):
        return "xgrammar_rejected"
    if reason.startswith("llguidance refused"):
        return "llguidance_refused"
    if "whitespace-pattern" in reason:
        return "whitespace_pattern"
    feature = reason[len("uses "):] if reason.startswith("uses ") else reason
    return "uses_" + re.sub(r"[^A-Za-z0-9]+", "_", feature).strip("_")
