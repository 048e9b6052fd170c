"""SGLang's native API: /generate, the model's info, and the health probes."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints.http_common import (
    SSE_DONE, abort_error, error_response, errors_as_events, last_output_or_disconnect, read_json, sse,
)
from srt.frontend.tokenizer_manager import GenerateReqInput, TokenizerManager

HEALTH_GENERATE_TIMEOUT_S = 60.0


async def health(request: Request) -> Response:
    if not request.app.state.tokenizer_manager.scheduler_alive():
        return error_response("A scheduler process has exited.", 503)
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """Healthy only if a one-token generation round-trips through the scheduler."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
    obj = GenerateReqInput(text="Hi", sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        out = await asyncio.wait_for(
            last_output_or_disconnect(request, tm.generate_request(obj)), HEALTH_GENERATE_TIMEOUT_S
        )
    except asyncio.TimeoutError:
        return error_response("Generation did not complete in time.", 503)
    if out is None or out["meta_info"]["finish_reason"]["type"] == "abort":
        return error_response("Generation failed.", 503)
    return Response(status_code=200)


async def model_info(request: Request) -> JSONResponse:
    # SGLang's keys; no --preferred-sampling-params and no weight updates here.
    args = request.app.state.server_args
    return JSONResponse({"model_path": args.model_path, "is_generation": True,
                         "tokenizer_path": args.tokenizer_path or args.model_path,
                         "served_model_name": request.app.state.served_model_name,
                         "preferred_sampling_params": None, "weight_version": "default"})


async def _sse_stream(tm: TokenizerManager, req) -> AsyncIterator[str]:
    """/generate's event stream: each output, an error as its last event, then [DONE]."""

    async def outputs():
        # aclosing: a client disconnect closes this generator -> abort in scheduler.
        async with contextlib.aclosing(tm.generate_request(req)) as outs:
            async for out in outs:
                yield sse(out)

    async for event in errors_as_events(outputs()):
        yield event
    yield SSE_DONE


async def generate(request: Request) -> Response:
    tm: TokenizerManager = request.app.state.tokenizer_manager
    try:
        req = await tm.prepare_request_async(GenerateReqInput.from_dict(await read_json(request)))
    except ValueError as e:
        return error_response(str(e))
    if req.stream:
        return StreamingResponse(_sse_stream(tm, req), media_type="text/event-stream")
    out = await last_output_or_disconnect(request, tm.generate_request(req))
    if out is None:
        return Response(status_code=499)  # client closed the connection
    for one in out if isinstance(out, list) else [out]:  # n > 1: a list of samples
        fr = one["meta_info"]["finish_reason"]
        if fr is not None and fr["type"] == "abort":
            return abort_error(fr)
    return JSONResponse(out)


def native_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/health_generate", health_generate, methods=["GET"])
    router.add_api_route("/get_model_info", model_info, methods=["GET"])
    router.add_api_route("/generate", generate, methods=["POST"])
    return router
