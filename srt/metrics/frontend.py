"""The frontend's metrics: one ``CollectorRegistry`` per TokenizerManager (never
prometheus_client's global REGISTRY), holding the request metrics it observes and the
scheduler metrics its DP groups send. ``render()`` is the body of GET /metrics."""
from __future__ import annotations

from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from srt.metrics.messages import SchedulerMetrics
from srt.metrics.scheduler_collector import SchedulerMetricsCollector
from srt.metrics.tokenizer_metrics import RequestTimer, TokenizerMetricsCollector

__all__ = ["CONTENT_TYPE_LATEST", "FrontendMetrics", "create_frontend_metrics"]


def model_name_of(server_args) -> str:
    """The ``model_name`` label: what /v1/models reports."""
    return (getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", None)
            or "default")


class FrontendMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.requests = TokenizerMetricsCollector(self.registry, model_name)
        self.schedulers = SchedulerMetricsCollector(model_name)
        self.registry.register(self.schedulers)
        self.model_name = model_name
        # Structured outputs (docs/constrained.md): per grammar backend, gramsync's own names.
        labels = ("model_name", "backend")
        self.approximated = Counter("gramsync:grammar_approximated_requests_total", "json_schema requests "
                                    "served by an approximate grammar (their documents are validated).",
                                    labels, registry=self.registry)
        self.violations = Counter("gramsync:schema_violations_total", "Finished json_schema documents that "
                                  "failed validation against the full schema.",
                                  labels, registry=self.registry)

    def on_validated(self, backend: str, approximate: bool, violated: bool) -> None:
        if approximate:
            self.approximated.labels(self.model_name, backend).inc()
        if violated:
            self.violations.labels(self.model_name, backend).inc()

    def start_request(self, req) -> RequestTimer:
        """``req``: the TokenizedGenerateReq just sent."""
        return self.requests.start_request(req.stream, req.sampling_params.constraint is not None)

    def on_scheduler_metrics(self, msg: SchedulerMetrics) -> None:
        self.schedulers.update(msg)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_frontend_metrics(server_args) -> Optional[FrontendMetrics]:
    """The metrics of a frontend started with --enable-metrics; None otherwise (then every
    hook in the TokenizerManager is a skipped None check)."""
    if not getattr(server_args, "enable_metrics", False):
        return None
    return FrontendMetrics(model_name_of(server_args))
