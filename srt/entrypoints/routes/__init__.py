"""The HTTP routes, one ``APIRouter`` per API. Handlers are plain module functions that read
the server's shared state from ``request.app.state`` (set once in ``create_app``), so a
router holds no state of its own and each ``*_router()`` call builds a fresh one."""
from srt.entrypoints.routes.admin import admin_router
from srt.entrypoints.routes.metrics import metrics_router
from srt.entrypoints.routes.native import native_router
from srt.entrypoints.routes.openai import openai_router

__all__ = ["admin_router", "metrics_router", "native_router", "openai_router"]
