"""Admin endpoints (SGLang's): the server's configuration, cache flush and request abort.
These are the paths HttpGuard admits with --admin-api-key (srt/security/http_guard.py)."""
from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from srt.entrypoints.http_common import error_response, read_json
from srt.frontend.tokenizer_manager import TokenizerManager
from srt.transport.io_struct import ANSWERED_ABORT
from srt.version import __version__

ADMIN_ABORT_MESSAGE = "Request aborted by an administrator (/abort_request)."


async def server_info(request: Request) -> JSONResponse:
    t = request.app.state.tokenizer_manager
    args = dataclasses.asdict(request.app.state.server_args)
    for secret in ("api_key", "admin_api_key"):  # never echo a key
        args[secret] = "<set>" if args[secret] else None
    return JSONResponse({
        **args,
        **dataclasses.asdict(t.scheduler_info),
        "num_inflight_requests": len(t.rid_to_state),
        "num_aborted_requests": t.num_aborted,
        "num_dropped_messages": t.recv_drops.count,
        "num_refused_handshakes": t.transport.refused_handshakes,
        # Documents of approximate grammars checked against their schema (docs/constrained.md).
        "schema_validation": dataclasses.asdict(t.documents.validators.stats),
        "version": __version__,
    })


async def flush_cache(request: Request) -> Response:
    """Admin (SGLang's endpoint): empty the radix prefix cache; refused (400) while
    requests are running or waiting."""
    out = await request.app.state.tokenizer_manager.flush_cache()
    if not out.success:
        return error_response(out.message, 400)
    return JSONResponse({"message": out.message})


def _running(t: TokenizerManager, rid: str) -> bool:
    # n > 1: the request's id names its group of samples.
    return rid in t.rid_to_state or rid in getattr(t, "sample_groups", {})


def _rids_to_abort(t: TokenizerManager, body: dict) -> list[str]:
    """Every running request for abort_all; else the one id, also accepted as an OpenAI
    response id (chatcmpl-<rid> / cmpl-<rid>), kept as sent when nothing matches."""
    if body.get("abort_all") is True:
        return list(t.rid_to_state)
    rid = body["rid"]
    candidates = (rid, rid.removeprefix("chatcmpl-"), rid.removeprefix("cmpl-"))
    return [next((r for r in candidates if _running(t, r)), rid)]


async def abort_request(request: Request) -> Response:
    """Admin (SGLang's endpoint and body, {"rid": ..., "abort_all": false}): abort one
    request by id -- also as an OpenAI response id, chatcmpl-<rid> / cmpl-<rid> -- or
    all with abort_all. Each is answered as SGLang answers it: 200 with its partial output
    and finish reason abort carrying the message (a stream: its last event)."""
    t: TokenizerManager = request.app.state.tokenizer_manager
    body = await read_json(request)
    if not isinstance(body, dict) or not (isinstance(body.get("rid"), str) or body.get("abort_all") is True):
        return error_response('Send {"rid": "<request id>"} or {"abort_all": true}.')
    found = [rid for rid in _rids_to_abort(t, body) if _running(t, rid)]
    for rid in found:
        t.abort_request(rid, ADMIN_ABORT_MESSAGE, ANSWERED_ABORT)
    if not found and body.get("abort_all") is not True:
        return error_response(f"No request with id {body['rid']!r} is running.", 404)
    return JSONResponse({"aborted": found})


def admin_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/get_server_info", server_info, methods=["GET"])
    router.add_api_route("/flush_cache", flush_cache, methods=["POST"])
    router.add_api_route("/abort_request", abort_request, methods=["POST"])
    return router
