"""Frontend side of the scheduler metrics: keeps the latest ``SchedulerMetrics`` of each DP
group and renders it at scrape time (a custom prometheus_client collector: the numbers
are the scheduler's, cumulative where they are counters, so nothing is re-counted here).
Every sample carries ``model_name`` and ``dp_rank``."""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from srt.metrics.messages import HistogramData, SchedulerMetrics

LABELS = ("model_name", "dp_rank")

# (metric name, SchedulerMetrics field, help): SGLang's names and meanings.
GAUGES = (
    ("sglang:num_running_reqs", "num_running_reqs", "The number of running requests."),
    ("sglang:num_queue_reqs", "num_queue_reqs",
     "The number of requests waiting to run (for a prefill or for their grammar compile)."),
    ("sglang:num_grammar_queue_reqs", "num_grammar_queue_reqs",
     "The number of requests waiting for their grammar compile."),
    ("sglang:num_used_tokens", "num_used_tokens", "The number of used KV-cache tokens."),
    ("sglang:max_total_num_tokens", "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    ("sglang:token_usage", "token_usage", "The token usage (used / max total tokens)."),
    ("sglang:gen_throughput", "gen_throughput", "The generation throughput (token/s) over the last interval."),
    ("sglang:cache_hit_rate", "cache_hit_rate",
     "The prefix cache hit rate of the prompts admitted in the last interval."),
    ("sglang:spec_accept_length", "spec_accept_length",
     "Tokens a running request gained per decode step over the last interval (speculative "
     "decoding's acceptance length; 0 before any decode step)."),
)
# (name without _total, GrammarMetricsData field, help)
GRAMMAR_COUNTERS = (
    ("sglang:num_grammar_cache_hit", "cache_hits", "Number of grammar cache hits."),
    ("sglang:num_grammar_cache_miss", "cache_misses",
     "Number of constrained requests whose grammar had to be compiled (or was compiling)."),
    ("sglang:num_grammar_timeout", "timeouts", "Number of grammar compile timeouts (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS)."),
    ("sglang:num_grammar_aborted", "aborted", "Number of requests aborted because of their grammar."),
)


class SchedulerMetricsCollector(Collector):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.latest: dict[int, SchedulerMetrics] = {}  # dp_rank -> its last message

    def update(self, msg: SchedulerMetrics) -> None:
        self.latest[msg.dp_rank] = msg

    def describe(self) -> list:
        return []  # names are fixed; nothing to check at registration

    def collect(self) -> Iterator:
        groups = [(self._labels(m), m) for _, m in sorted(self.latest.items())]
        for name, field, doc in GAUGES:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            for labels, m in groups:
                g.add_metric(labels, getattr(m, field))
            yield g
        yield self._counter("sglang:num_retracted_requests", "Total number of retracted requests.",
                            (), [(lb, (), m.num_retracted_reqs) for lb, m in groups])
        yield self._counter("sglang:num_grammar", "Number of constrained requests (cache hits and misses).",
                            (), [(lb, (), m.grammar.cache_hits + m.grammar.cache_misses) for lb, m in groups])
        for name, field, doc in GRAMMAR_COUNTERS:
            yield self._counter(name, doc, (), [(lb, (), getattr(m.grammar, field)) for lb, m in groups])
        yield self._counter("sglang:num_grammar_compile_failed", "Number of grammar compiles that failed "
                            "(an invalid spec, or one that admits no output).", ("backend", "kind"),
                            [(lb, c.labels, c.value) for lb, m in groups for c in m.grammar.compile_failures])
        yield self._counter("sglang:num_grammar_auto_fallback", "Number of grammars --grammar-backend auto "
                            "did not serve with plain xgrammar, by reason and outcome.", ("reason", "outcome"),
                            [(lb, c.labels, c.value) for lb, m in groups for c in m.grammar.auto_fallbacks])
        h = HistogramMetricFamily("sglang:grammar_compilation_time_seconds",
                                  "Histogram of grammar compilation time in seconds.",
                                  labels=LABELS + ("backend", "kind"))
        for labels, m in groups:
            for lh in m.grammar.compile_seconds:
                _add_histogram(h, labels + list(lh.labels), lh.data)
        yield h
        h = HistogramMetricFamily("sglang:grammar_agreement_time_seconds",
                                  "Histogram of the time one cross-rank grammar agreement took (TP > 1).",
                                  labels=LABELS)
        for labels, m in groups:
            if sum(m.grammar.agreement_seconds.counts):
                _add_histogram(h, labels, m.grammar.agreement_seconds)
        yield h

    def _labels(self, m: SchedulerMetrics) -> list[str]:
        return [self.model_name, str(m.dp_rank)]

    @staticmethod
    def _counter(name: str, doc: str, extra: tuple, rows: list) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS + extra)
        for labels, extra_values, value in rows:
            c.add_metric(labels + list(extra_values), value)
        return c


def _add_histogram(family: HistogramMetricFamily, labels: list[str], data: HistogramData) -> None:
    buckets, total = [], 0
    for bound, count in zip(data.bounds, data.counts):
        total += count
        buckets.append((floatToGoString(bound), total))
    buckets.append(("+Inf", total + sum(data.counts[len(data.bounds):])))
    family.add_metric(labels, buckets, data.sum)
