"""Handlers for /v1/chat/completions and /v1/completions, plus the HTTP helpers that the
native /generate endpoint shares (JSON parsing, error responses, disconnect handling)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from srt.entrypoints.json_body import parse_json_body
from srt.entrypoints.openai_logprobs import TokenTexts, chat_logprobs
from srt.entrypoints.openai_protocol import ChatCompletionRequest, error_body, validation_error_message
from srt.entrypoints.openai_responses import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionResponse, ChatCompletionStreamChoice, ChatMessageOut,
    DeltaMessage, PromptTokensDetails, UsageInfo,
)
from srt.function_call.serving import ToolCalling
from srt.managers.generate_input import check_fits_context
from srt.managers.samples import combine_usage
from srt.managers.tokenizer_manager import OFFLOOP_CHARS, TokenizerManager
from srt.security.http_guard import read_body_limited
from srt.tokenizer_utils import apply_chat_template

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


def abort_error(finish_reason: dict) -> JSONResponse:
    return error_response(finish_reason.get("message") or "Request aborted.",
                          finish_reason.get("status_code") or 500)


def _usage(meta: dict) -> UsageInfo:  # one output's meta_info, or combine_usage's counts
    p, c = meta["prompt_tokens"], meta["completion_tokens"]
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=meta.get("cached_tokens", 0)))


async def choice_outputs(tm: TokenizerManager, req) -> AsyncIterator[tuple[int, Any]]:
    """A streamed request's outputs as (choice index, output); an abort comes as
    (index, its SSE error event) and ends it. Closing this aborts the request."""
    async with contextlib.aclosing(tm.generate_request(req)) as outputs:
        async for out in outputs:
            fr = out["meta_info"]["finish_reason"]
            if fr is not None and fr["type"] == "abort":
                yield out.get("index", 0), sse(error_body(fr.get("message") or "Request aborted.",
                                                          fr.get("status_code") or 500))
                return
            yield out.get("index", 0), out


def usage_of(outs: list[dict]) -> UsageInfo:
    """Usage of a request's outputs (n > 1: the prompt once, every sample's completion)."""
    return _usage(combine_usage(outs))


@dataclass
class ChoiceStream:
    """What one streamed choice has sent so far."""

    tools: Any  # its tool-call stream parser
    sent: str = ""
    logprobs_sent: int = 0


def _finish(fr: Optional[dict]) -> tuple[Optional[str], Any]:
    """(OpenAI finish_reason, SGLang matched_stop)."""
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched")


def structured_output(meta: dict) -> dict:
    """A choice's structured-output fields (README): ``grammar`` (what served its json_schema)
    and ``schema_violation`` (finish_reason "schema_violation": the validator's message,
    keyword and paths). Empty until the request finishes."""
    fr, out = meta.get("finish_reason"), {}
    if fr is not None and meta.get("grammar") is not None:
        out["grammar"] = meta["grammar"]
    if fr is not None and fr["type"] == "schema_violation":
        # "part": the structural-tag part (a tool call's: its function name) that broke its schema
        out["schema_violation"] = {k: fr[k] for k in ("message", "keyword", "path", "schema_path", "part")
                                   if k in fr}
    return out


class OpenAIServing:
    def __init__(self, tokenizer_manager: TokenizerManager, served_model_name: str):
        self.tm = tokenizer_manager
        self.served_model_name = served_model_name
        self.token_texts = TokenTexts(tokenizer_manager.tokenizer)  # for logprobs

    async def _parse(self, request: Request, model_cls):
        """Parse and validate; a user error comes back as a 400 JSONResponse."""
        try:
            data = await read_json(request)
            if request.state.body_bytes > OFFLOOP_BODY_BYTES:  # a 10 MB tools list: ~100 ms
                body = await self.tm.offload(model_cls.model_validate, data)
            else:
                body = model_cls.model_validate(data)
        except ValidationError as e:
            msg, param = validation_error_message(e)
            return None, error_response(msg, 400, param)
        except ValueError as e:
            return None, error_response(str(e))
        return body, None

    async def _final_output(self, request: Request, req) -> tuple[Optional[dict], Optional[Response]]:
        """Run a non-streaming request: (output, None), or (None, the error response)."""
        out = await last_output_or_disconnect(request, self.tm.generate_request(req))
        if out is None:
            return None, Response(status_code=499)  # nobody is listening any more
        outs = out if isinstance(out, list) else [out]  # n > 1: one output per sample
        for one in outs:
            fr = one["meta_info"]["finish_reason"]
            if fr and fr["type"] == "abort":
                return None, abort_error(fr)
        return outs, None

    async def chat_completions(self, request: Request) -> Response:
        body, err = await self._parse(request, ChatCompletionRequest)
        if err is not None:
            return err
        try:
            if request.state.body_bytes > OFFLOOP_CHARS:  # tools, templating, tokenizing: off the loop
                obj, tools = await self.tm.offload(self._prepare_chat, body)
            else:
                obj, tools = self._prepare_chat(body)
            req = await self.tm.prepare_request_async(obj)
        except ValueError as e:
            return error_response(str(e), param=getattr(e, "param", None))
        model = body.model or self.served_model_name
        if body.stream:
            return StreamingResponse(self._chat_stream(req, model, body.include_usage, tools, bool(body.logprobs)),
                                     media_type="text/event-stream")
        outs, err = await self._final_output(request, req)
        if err is not None:
            return err
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            reason, matched = _finish(meta["finish_reason"])
            message, reason = tools.message(out["text"], reason)
            logprobs = chat_logprobs(meta, out["output_ids"], self.token_texts) if body.logprobs else None
            choices.append(ChatCompletionChoice(index=i, message=ChatMessageOut(**message), logprobs=logprobs,
                                                finish_reason=reason, matched_stop=matched,
                                                **structured_output(meta)))
        resp = ChatCompletionResponse(id=f"chatcmpl-{req.rid}", model=model, usage=usage_of(outs), choices=choices)
        return JSONResponse(resp.model_dump())

    def _prepare_chat(self, body) -> tuple[Any, ToolCalling]:
        """The chat request as a GenerateReqInput, and its tool calling. Everything that
        reaches the template counts toward the pre-tokenize length check (messages, the
        history's calls, the tools list)."""
        messages = [m.for_template() for m in body.messages]
        tools, messages, tool_kwargs = ToolCalling.prepare(
            body, messages, self.tm.tokenizer, self.tm.server_args,
            lambda chars: check_fits_context(chars, self.tm.context_len, self.tm.max_token_chars))
        ids = apply_chat_template(self.tm.tokenizer, messages, **(body.chat_template_kwargs or {}), **tool_kwargs)
        obj = body.generate_input(uuid.uuid4().hex, input_ids=ids)
        tools.constrain(obj.sampling_params)  # the tool-call grammar (srt/function_call)
        obj.require_reasoning = body.requires_reasoning(self.tm.server_args.reasoning_parser)
        return obj, tools

    async def _chat_stream(self, req, model: str, include_usage: bool, tools, want_logprobs: bool
                           ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(delta: DeltaMessage, reason=None, matched=None, index: int = 0, logprobs=None,
                  meta: Optional[dict] = None) -> str:
            return sse(ChatCompletionChunk(
                id=f"chatcmpl-{req.rid}", created=created, model=model,
                choices=[ChatCompletionStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                    finish_reason=reason, matched_stop=matched,
                                                    **structured_output(meta or {}))],
            ))

        for i in range(req.sampling_params.n):
            yield chunk(DeltaMessage(role="assistant", content=""), index=i)
        events = self._chat_events(req, chunk, created, model, include_usage, tools, want_logprobs)
        async for event in errors_as_events(events):
            yield event
        yield SSE_DONE

    async def _chat_events(self, req, chunk, created: int, model: str, include_usage: bool, tools,
                           want_logprobs: bool):
        n = req.sampling_params.n
        validators = self.tm.documents.validators

        def valid(schema: str, arguments: str) -> bool:
            try:
                return validators.validate(schema, arguments) is None
            except ValueError:  # a schema the validator cannot build: never "valid"
                return False

        streams = [ChoiceStream(tools.stream(valid)) for _ in range(n)]  # one parser per choice
        finals: dict[int, dict] = {}
        async for i, out in choice_outputs(self.tm, req):
            if isinstance(out, str):  # aborted: the error event ends the stream
                yield out
                break
            st, fr = streams[i], out["meta_info"]["finish_reason"]
            logprobs = None
            if want_logprobs:
                logprobs = chat_logprobs(out["meta_info"], out["output_ids"], self.token_texts, st.logprobs_sent)
                st.logprobs_sent += len(logprobs.content)
                logprobs = logprobs if logprobs.content else None
            deltas = []
            if len(out["text"]) > len(st.sent):
                deltas = list(st.tools.deltas(out["text"][len(st.sent):]))  # content and tool-call deltas
                st.sent = out["text"]
            if logprobs is not None and not deltas:
                deltas = [{"content": ""}]  # logprobs of tokens whose text is held back
            for k, delta in enumerate(deltas):
                yield chunk(DeltaMessage(**delta), index=i, logprobs=logprobs if k == 0 else None)
            if fr is not None:
                finals[i] = out
                reason, matched = _finish(fr)
                last_deltas, reason = st.tools.finish(reason)
                for delta in last_deltas:
                    yield chunk(DeltaMessage(**delta), index=i)
                yield chunk(DeltaMessage(), reason, matched, index=i, meta=out["meta_info"])
        if include_usage and len(finals) == n:
            yield sse(ChatCompletionChunk(id=f"chatcmpl-{req.rid}", created=created, model=model,
                                          choices=[], usage=usage_of([finals[i] for i in range(n)])))

    async def completions(self, request: Request) -> Response:
        from srt.entrypoints.openai_completions import serve_completions

        return await serve_completions(self, request)
