"""Entry-rank side of ``--enable-metrics``: counts what the frontend cannot see (tokens per
step, prefix-cache hits at admission) and sends a ``SchedulerMetrics`` message at most every
``interval`` seconds, and only when it differs from the last one sent (an idle server
sends nothing).

Only entry ranks build one. It reads scheduler state and never changes it, and it takes
part in no collective: the other ranks of a TP group run the same batches and compile the
same grammars, so one rank's numbers describe the group, and lock-step is untouched.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from srt.metrics.messages import GrammarMetricsData, HistogramData, LabeledCount, LabeledHistogram, SchedulerMetrics

SCHEDULER_METRICS_INTERVAL = 1.0  # seconds between two messages, at most one per interval


class SchedulerMetricsReporter:
    def __init__(self, dp_rank: int, interval: float = SCHEDULER_METRICS_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.dp_rank = dp_rank
        self.interval = interval
        self.clock = clock
        self._last_time = clock()
        self._last_sent: Optional[SchedulerMetrics] = None
        self._lens: dict[int, int] = {}  # id(req) -> output length before this batch
        # Since the last message:
        self._gen_tokens = self._prompt_tokens = self._cached_tokens = 0
        self._hit_rate = 0.0  # kept while no request is admitted
        self._decode_batch = False
        self._decode_tokens = self._decode_req_steps = 0  # since the last message
        self._accept_length = 0.0  # kept while nothing decodes

    @classmethod
    def create(cls, server_args, rank_info) -> Optional["SchedulerMetricsReporter"]:
        """One for an entry rank of a server with --enable-metrics, else None."""
        if not getattr(server_args, "enable_metrics", False) or not rank_info.is_entry_rank:
            return None
        return cls(rank_info.dp_rank)

    # ---- around each batch ---------------------------------------------------------
    def before_batch(self, extend: bool, reqs: list) -> None:
        if extend:  # first admissions: their prefix-cache match is final now
            for r in reqs:
                if r.first_scheduled_time is None:
                    self._prompt_tokens += len(r.origin_input_ids)
                    self._cached_tokens += r.cached_tokens or 0
        self._lens = {id(r): len(r.output_ids) for r in reqs}
        self._decode_batch = not extend

    def after_batch(self, reqs: list) -> None:
        """Tokens the batch appended (sampled and fast-forwarded); a mid-prefill chunk
        left the list and appended nothing."""
        lens = self._lens
        gained = sum(max(len(r.output_ids) - lens.get(id(r), len(r.output_ids)), 0) for r in reqs)
        self._gen_tokens += gained
        if self._decode_batch:
            self._decode_tokens += gained
            self._decode_req_steps += len(reqs)
        self._lens = {}

    # ---- reporting -----------------------------------------------------------------
    def maybe_send(self, scheduler, send: Callable[[SchedulerMetrics], None]) -> None:
        now = self.clock()
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        msg = self.build(scheduler, elapsed)
        self._last_time = now
        self._gen_tokens = self._prompt_tokens = self._cached_tokens = 0
        self._decode_tokens = self._decode_req_steps = 0
        if msg != self._last_sent:
            send(msg)
            self._last_sent = msg

    def build(self, scheduler, elapsed: float) -> SchedulerMetrics:
        if self._prompt_tokens:
            self._hit_rate = self._cached_tokens / self._prompt_tokens
        if self._decode_req_steps:
            self._accept_length = self._decode_tokens / self._decode_req_steps
        size = scheduler.kv.allocator.size
        used = size - scheduler.kv.available_tokens()  # cached-but-evictable counts as free
        manager = scheduler.grammar_manager
        grammar_queue = len(manager.grammar_queue)
        return SchedulerMetrics(
            dp_rank=self.dp_rank,
            num_running_reqs=len(scheduler.running),
            num_queue_reqs=len(scheduler.waiting) + grammar_queue,
            num_grammar_queue_reqs=grammar_queue,
            num_used_tokens=used,
            max_total_num_tokens=size,
            token_usage=used / size if size else 0.0,
            gen_throughput=self._gen_tokens / elapsed if elapsed > 0 else 0.0,
            cache_hit_rate=self._hit_rate,
            num_retracted_reqs=scheduler.num_retractions,
            grammar=grammar_data(manager.metrics.snapshot()),
            spec_accept_length=self._accept_length,
        )


def grammar_data(snap) -> GrammarMetricsData:
    """``constrained.grammar_metrics.GrammarMetricsSnapshot`` -> the wire form (sorted, so
    equal counters give equal messages)."""
    return GrammarMetricsData(
        compile_seconds=tuple(LabeledHistogram(k, _hist(v)) for k, v in sorted(snap.compile_seconds.items())),
        compile_failures=tuple(LabeledCount(k, v) for k, v in sorted(snap.compile_failures.items())),
        auto_fallbacks=tuple(LabeledCount(k, v) for k, v in sorted(snap.auto_fallbacks.items())),
        cache_hits=snap.cache_hits, cache_misses=snap.cache_misses, timeouts=snap.timeouts,
        aborted=snap.aborted, agreement_seconds=_hist(snap.agreement_seconds))


def _hist(frozen: tuple) -> HistogramData:
    bounds, counts, total = frozen
    return HistogramData(tuple(bounds), tuple(counts), float(total))
