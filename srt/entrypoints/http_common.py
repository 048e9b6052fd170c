"""HTTP helpers shared by the native and the OpenAI endpoints: JSON bodies read within the
size limit (large ones parsed off the event loop), OpenAI-shaped error responses, SSE
framing, and waiting for a result while watching for a client that went away."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from srt.entrypoints.json_body import parse_json_body
from srt.entrypoints.openai_protocol import error_body
from srt.security.http_guard import read_body_limited
from srt.transport.io_struct import ANSWERED_ABORT

OFFLOOP_BODY_BYTES = 1 << 20  # larger bodies are parsed off the event loop
DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks for a gone client
SSE_DONE = "data: [DONE]\n\n"


def error_response(message: str, status_code: int = 400, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param), status_code=status_code)


def sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


async def read_json(request: Request) -> Any:
    """The JSON body, read up to --max-request-bytes (else RequestTooLarge: 413); a large
    body is parsed on a worker thread so the event loop keeps serving others."""
    body = await read_body_limited(request, request.app.state.http_guard.max_request_bytes)
    request.state.body_bytes = len(body)  # handlers move large requests' work off the loop
    if len(body) > OFFLOOP_BODY_BYTES:
        return await request.app.state.tokenizer_manager.offload(parse_json_body, body)
    return parse_json_body(body)


async def last_output_or_disconnect(request: Request, outputs: AsyncIterator[dict]) -> Optional[dict]:
    """Drain ``outputs``; return its last item, or None if the client disconnected first
    (then the generator is cancelled, which aborts the request in the scheduler)."""

    async def drain():
        last = None
        async for out in outputs:
            last = out
        return last

    task = asyncio.create_task(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:  # disconnected, or this handler itself was cancelled
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def errors_as_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started, a user error becomes an SSE error event, never a cut."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except ValueError as e:
        yield sse(error_body(str(e)))


def is_error_abort(finish_reason: Optional[dict]) -> bool:
    """An abort answered with an error (grammar failure 400, timeout or shutdown 503, ...),
    not with the partial output: every abort but an administrator's (status 200, SGLang's
    answer to /abort_request)."""
    return (finish_reason is not None and finish_reason["type"] == "abort"
            and finish_reason.get("status_code") != ANSWERED_ABORT)


def abort_error(finish_reason: dict) -> JSONResponse:
    return error_response(finish_reason.get("message") or "Request aborted.",
                          finish_reason.get("status_code") or 500)


def abort_event(finish_reason: dict) -> str:
    """The SSE error event of an error abort (OpenAI streams end with it)."""
    return sse(error_body(finish_reason.get("message") or "Request aborted.",
                          finish_reason.get("status_code") or 500))


async def final_output(request: Request, outputs: AsyncIterator[Any]) -> tuple[Optional[list], Optional[Response]]:
    """Run a non-streaming request to its end: (its outputs -- one, or n for n > 1 --, None)
    or (None, the error response): 499 when the client went away, the abort's error for an
    error abort of any sample."""
    out = await last_output_or_disconnect(request, outputs)
    if out is None:
        return None, Response(status_code=499)  # nobody is listening any more
    outs = out if isinstance(out, list) else [out]
    for one in outs:
        if is_error_abort(one["meta_info"]["finish_reason"]):
            return None, abort_error(one["meta_info"]["finish_reason"])
    return outs, None


async def final_outputs(request: Request, runs: list) -> tuple[Optional[list], Optional[Response]]:
    """``final_output`` of several requests at once (a batch), each given as a function
    returning its outputs' iterator: every one's outputs in order, or the first error
    response (the others are then aborted)."""
    tasks = [asyncio.create_task(final_output(request, run())) for run in runs]
    try:
        for done in asyncio.as_completed(tasks):
            _, err = await done
            if err is not None:
                return None, err
        return [t.result()[0] for t in tasks], None
    finally:  # an error or a cancelled handler: cancelling aborts the unfinished requests
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
