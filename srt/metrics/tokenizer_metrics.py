"""Request metrics the frontend observes itself (SGLang's TokenizerMetricsCollector names):
token counters and the TTFT, inter-token and end-to-end latency histograms.

The TokenizerManager calls in at three points: a request is sent (``start_request``
returns a ``RequestTimer``, kept on the request's state), a scheduler message for it
arrives (``RequestTimer.on_output``), the client went away before it finished
(``RequestTimer.on_client_abort``). With metrics off the manager holds None and skips
every call.

The scheduler sends a non-streaming request's tokens in one message at its end, so the
first-token and inter-token latencies are observed for streaming requests only (for a
non-streaming one they would just repeat its end-to-end latency).
"""
from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)


class TokenizerMetricsCollector:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ("model_name",)

        def counter(name: str, doc: str):
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, labels, registry=registry, buckets=buckets).labels(model_name)

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.so_requests = counter("sglang:num_so_requests_total", "Number of structured output requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds (streaming requests).", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds (streaming requests).", ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds", E2E_BUCKETS)

    def start_request(self, stream: bool, constrained: bool) -> "RequestTimer":
        """The request was just sent to the scheduler."""
        return RequestTimer(self, stream, constrained)


class RequestTimer:
    __slots__ = ("m", "stream", "constrained", "created", "last", "last_tokens", "done")

    def __init__(self, m: TokenizerMetricsCollector, stream: bool, constrained: bool):
        self.m, self.stream, self.constrained = m, stream, constrained
        self.created = time.perf_counter()
        self.last: Optional[float] = None  # when the previous message arrived
        self.last_tokens = 0
        self.done = False

    def on_output(self, finish_reason, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """A scheduler message for this request arrived (``finish_reason`` None: more follow)."""
        if self.done:
            return
        now = time.perf_counter()
        m = self.m
        if self.stream and completion_tokens > self.last_tokens:
            if self.last is None:
                m.ttft.observe(now - self.created)
            else:  # each token of the message gets an equal share of the interval (SGLang)
                new = completion_tokens - self.last_tokens
                for _ in range(new):
                    m.itl.observe((now - self.last) / new)
            self.last, self.last_tokens = now, completion_tokens
        if finish_reason is None:
            return
        self.done = True
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(completion_tokens)
        m.cached_tokens.inc(cached_tokens)
        m.requests.inc()
        m.e2e.observe(now - self.created)
        if self.constrained:
            m.so_requests.inc()
        if finish_reason.type == "abort":
            m.aborted.inc()

    def on_client_abort(self) -> None:
        """The client went away (disconnect, cancel) before the request finished."""
        if not self.done:
            self.done = True
            self.m.aborted.inc()
