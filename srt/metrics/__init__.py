"""Prometheus metrics (``--enable-metrics``, GET /metrics).

Scheduler ranks cannot serve HTTP: the entry rank of each DP group sends a throttled
``SchedulerMetrics`` message (``messages.py``, built by ``scheduler_reporter.py``) to the
frontend, which keeps the latest one per DP group (``scheduler_collector.py``) and observes
request latencies and token counts itself (``tokenizer_metrics.py``). ``frontend.py`` owns
the ``CollectorRegistry`` (one per TokenizerManager, never prometheus_client's global one)
and renders the text exposition format.
"""
