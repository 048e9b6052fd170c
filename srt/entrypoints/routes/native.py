"""SGLang's native API: /generate, the model's info, and the health probes."""
from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints.http_common import (
    SSE_DONE, error_response, errors_as_events, final_outputs, last_output_or_disconnect, read_json, sse,
)
from srt.frontend.generate_batch import batch_size, split_batch
from srt.frontend.samples import merge_samples, split_samples
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


async def _prepare(tm: TokenizerManager, body) -> list:
    """The body's prepared requests: one, or one per prompt of a batch (generate_batch.py;
    a bad prompt fails the whole batch before anything runs, its 400 naming it)."""
    items = split_batch(body)
    if items is None:
        return [await tm.prepare_request_async(GenerateReqInput.from_dict(body))]
    reqs, seen = [], set()
    for k, item in enumerate(items):
        try:
            req = await tm.prepare_request_async(GenerateReqInput.from_dict(item))
        except ValueError as e:
            raise ValueError(f"Batch item {k}: {e}") from None
        ids = {req.rid, *(part.rid for part in split_samples(req))}
        if ids & seen:
            raise ValueError(f"Batch item {k}: its request id {req.rid!r} repeats another item's.")
        seen |= ids
        reqs.append(req)
    return reqs


def _offsets(reqs: list) -> list[int]:
    """Where each prompt's outputs start in the batch's flat list (prompt k's n samples)."""
    out, at = [], 0
    for r in reqs:
        out.append(at)
        at += r.sampling_params.n
    return out


async def _sse_stream(tm: TokenizerManager, reqs: list, batched: bool) -> AsyncIterator[str]:
    """/generate's event stream: each output (a batch: each prompt's, with its flat
    ``index``), an error as its last event, then [DONE]. A prompt's abort is its own last
    output (finish reason abort); the others go on."""

    async def outputs():
        # aclosing: a client disconnect closes this generator -> abort in scheduler.
        if not batched:
            async with contextlib.aclosing(tm.generate_request(reqs[0])) as outs:
                async for out in outs:
                    yield sse(out)
            return
        offsets = _offsets(reqs)
        async with contextlib.aclosing(merge_samples([tm.generate_request(r) for r in reqs])) as outs:
            async for k, out in outs:
                out["index"] = offsets[k] + out.get("index", 0)
                yield sse(out)

    async for event in errors_as_events(outputs()):
        yield event
    yield SSE_DONE


async def generate(request: Request) -> Response:
    """SGLang's /generate: one prompt (an output; n > 1: a list of n) or a batch (a flat list,
    prompt k's samples together, in order). An administrator's abort answers 200 with the
    partial output; an error abort (400, 503, ...) answers with its error."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
    try:
        body = await read_json(request)
        batched = batch_size(body) is not None
        reqs = await _prepare(tm, body)
    except ValueError as e:
        return error_response(str(e))
    if reqs[0].stream:
        return StreamingResponse(_sse_stream(tm, reqs, batched), media_type="text/event-stream")
    groups, err = await final_outputs(request, [functools.partial(tm.generate_request, r) for r in reqs])
    if err is not None:
        return err
    if not batched:
        outs = groups[0]
        return JSONResponse(outs if reqs[0].sampling_params.n > 1 else outs[0])
    flat = [out for outs in groups for out in outs]
    for i, out in enumerate(flat):
        out["index"] = i
    return JSONResponse(flat)


def native_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/health_generate", health_generate, methods=["GET"])
    router.add_api_route("/get_model_info", model_info, methods=["GET"])
    router.add_api_route("/generate", generate, methods=["POST"])
    return router
