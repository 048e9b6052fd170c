"""The metrics message an entry rank sends to the frontend (frozen; typed msgpack on the
wire, registered in ``FRONTEND_INPUT_CODEC``). Grammar numbers are cumulative since the
rank started, so the frontend only ever keeps the latest message of each DP group."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HistogramData:
    """A cumulative histogram: ``counts[i]`` observations in bucket i (upper bound
    ``bounds[i]``; the last count is the +Inf bucket), and their sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float


@dataclass(frozen=True)
class LabeledHistogram:
    labels: tuple[str, ...]
    data: HistogramData


@dataclass(frozen=True)
class LabeledCount:
    labels: tuple[str, ...]
    value: int


@dataclass(frozen=True)
class GrammarMetricsData:
    compile_seconds: tuple[LabeledHistogram, ...]  # labels (backend, kind)
    compile_failures: tuple[LabeledCount, ...]  # labels (backend, kind)
    auto_fallbacks: tuple[LabeledCount, ...]  # labels (reason, outcome)
    cache_hits: int
    cache_misses: int
    timeouts: int
    aborted: int
    agreement_seconds: HistogramData


@dataclass(frozen=True)
class SchedulerMetrics:
    """One DP group's state, sent at most every ``SCHEDULER_METRICS_INTERVAL`` seconds
    and only when something changed."""

    dp_rank: int
    num_running_reqs: int
    num_queue_reqs: int  # waiting for a prefill, plus waiting for a grammar compile
    num_grammar_queue_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    gen_throughput: float  # generated tokens per second over the last interval
    cache_hit_rate: float  # prompt tokens served by the radix cache over the last interval
    num_retracted_reqs: int  # cumulative
    grammar: GrammarMetricsData
    # Tokens a running request gained per decode step over the last interval (speculative
    # decoding's acceptance length; above 1 also with grammar fast-forward).
    spec_accept_length: float = 0.0
