"""/v1/completions: one prompt, ``n`` choices, optional logprobs, streamed or not."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints.openai_logprobs import completion_logprobs
from srt.entrypoints.openai_protocol import CompletionRequest
from srt.entrypoints.openai_responses import CompletionChoice, CompletionResponse
from srt.entrypoints.openai_serving import (
    SSE_DONE, ChoiceStream, OpenAIServing, _finish, choice_outputs, error_response, errors_as_events, sse,
    structured_output, usage_of,
)


async def serve_completions(serving: OpenAIServing, request: Request) -> Response:
    body, err = await serving._parse(request, CompletionRequest)
    if err is not None:
        return err
    try:
        prompt = body.single_prompt()
        kind = "text" if isinstance(prompt, str) else "input_ids"
        obj = body.generate_input(uuid.uuid4().hex, **{kind: prompt})
        req = await serving.tm.prepare_request_async(obj)
    except ValueError as e:
        return error_response(str(e))
    model = body.model or serving.served_model_name
    want_logprobs = body.logprobs is not None
    if body.stream:
        return StreamingResponse(_stream(serving, req, model, body.include_usage, want_logprobs),
                                 media_type="text/event-stream")
    outs, err = await serving._final_output(request, req)
    if err is not None:
        return err
    choices = []
    for i, out in enumerate(outs):
        meta = out["meta_info"]
        reason, matched = _finish(meta["finish_reason"])
        logprobs = completion_logprobs(meta, out["output_ids"], serving.token_texts) if want_logprobs else None
        choices.append(CompletionChoice(index=i, text=out["text"], logprobs=logprobs,
                                        finish_reason=reason, matched_stop=matched, **structured_output(meta)))
    resp = CompletionResponse(id=f"cmpl-{req.rid}", model=model, usage=usage_of(outs), choices=choices)
    return JSONResponse(resp.model_dump())


async def _stream(serving: OpenAIServing, req, model: str, include_usage: bool,
                  want_logprobs: bool) -> AsyncIterator[str]:
    created = int(time.time())
    n = req.sampling_params.n

    def chunk(choices, usage=None) -> str:
        return sse(CompletionResponse(id=f"cmpl-{req.rid}", created=created, model=model,
                                      choices=choices, usage=usage))

    async def events():
        streams = [ChoiceStream(None) for _ in range(n)]
        finals: dict[int, dict] = {}
        async for i, out in choice_outputs(serving.tm, req):
            if isinstance(out, str):  # aborted: the error event ends the stream
                yield out
                break
            st, fr = streams[i], out["meta_info"]["finish_reason"]
            logprobs = None
            if want_logprobs:
                logprobs = completion_logprobs(out["meta_info"], out["output_ids"], serving.token_texts,
                                               st.logprobs_sent, text_offset=len(st.sent))
                st.logprobs_sent += len(logprobs.tokens)
                logprobs = logprobs if logprobs.tokens else None
            delta, st.sent = out["text"][len(st.sent):], out["text"]
            if delta or fr is not None or logprobs is not None:
                reason, matched = _finish(fr)
                yield chunk([CompletionChoice(index=i, text=delta, logprobs=logprobs, finish_reason=reason,
                                              matched_stop=matched, **structured_output(out["meta_info"]))])
            if fr is not None:
                finals[i] = out
        if include_usage and len(finals) == n:
            yield chunk([], usage=usage_of([finals[i] for i in range(n)]))

    async for event in errors_as_events(events()):
        yield event
    yield SSE_DONE
