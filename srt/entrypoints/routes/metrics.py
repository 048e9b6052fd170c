"""GET /metrics: the Prometheus exposition of ``app.state.metrics`` (--enable-metrics)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response


async def prometheus_metrics(request: Request) -> Response:
    metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=metrics.content_type)


def metrics_router() -> APIRouter:
    """Included only with --enable-metrics: without it /metrics is a 404, as in SGLang."""
    router = APIRouter()
    router.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    return router
