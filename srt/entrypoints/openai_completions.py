"""/v1/completions: one prompt or a batch, ``n`` choices each, optional logprobs, ``echo``
(the prompt, and with ``logprobs`` its token logprobs, before the completion), streamed or not.

A batch (a list of strings or of token-id lists) runs as one native request per prompt,
all at once; choice ``k * n + j`` is prompt k's j-th sample (OpenAI's order). A bad prompt
fails the whole request before anything runs (the 400 names it: ``prompt[k]: ...``); an
abort of one (timeout, full queue) fails it and aborts the others.

``echo`` + ``max_tokens: 0`` + ``logprobs`` scores a prompt: the scheduler prefills it,
records its logprobs and samples nothing. lm-evaluation-harness (0.4) sends ``max_tokens: 1``
and drops the last logprob entry, so a generated stop token is listed like any other.
"""
from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints.openai_logprobs import completion_logprobs, joined, prompt_logprobs
from srt.entrypoints.openai_protocol import CompletionRequest
from srt.entrypoints.openai_responses import CompletionChoice, CompletionResponse, PromptTokensDetails, UsageInfo
from srt.entrypoints.http_common import SSE_DONE, error_response, errors_as_events, final_outputs, sse
from srt.entrypoints.openai_choices import ChoiceStream, _finish, choice_outputs, structured_output, usage_of
from srt.entrypoints.openai_serving import OpenAIServing
from srt.frontend.samples import merge_samples


@dataclass(frozen=True)
class CompletionJob:
    """What the response needs besides the outputs: the prepared native requests, each
    prompt's echoed text (None without ``echo``), and the logprob and id settings."""

    reqs: list
    echo_texts: list[Optional[str]]
    want_logprobs: bool
    model: str

    @property
    def n(self) -> int:
        return self.reqs[0].sampling_params.n

    @property
    def response_id(self) -> str:
        return f"cmpl-{self.reqs[0].rid}"


async def serve_completions(serving: OpenAIServing, request: Request) -> Response:
    body, err = await serving._parse(request, CompletionRequest)
    if err is not None:
        return err
    prompts = body.prompts()
    reqs = []
    for k, prompt in enumerate(prompts):
        try:
            kind = "text" if isinstance(prompt, str) else "input_ids"
            obj = body.generate_input(uuid.uuid4().hex, **{kind: prompt})
            reqs.append(await serving.tm.prepare_request_async(obj))
        except ValueError as e:
            where = f"prompt[{k}]: " if len(prompts) > 1 else ""
            return error_response(where + str(e), param="prompt" if where else None)
    echo_texts = [_echo_text(serving, p, r) if body.echo else None for p, r in zip(prompts, reqs)]
    job = CompletionJob(reqs, echo_texts, body.logprobs is not None, body.model or serving.served_model_name)
    if body.stream:
        return StreamingResponse(_stream(serving, job, body.include_usage), media_type="text/event-stream")
    groups, err = await _final_outputs(serving, request, reqs)
    if err is not None:
        return err
    choices = [_choice(serving, job, k, j, out) for k, outs in enumerate(groups) for j, out in enumerate(outs)]
    resp = CompletionResponse(id=job.response_id, model=job.model, usage=_batch_usage(groups), choices=choices)
    return JSONResponse(resp.model_dump())


def _echo_text(serving: OpenAIServing, prompt, req) -> str:
    """The prompt as the choice's text starts: the string given, or the ids decoded."""
    return prompt if isinstance(prompt, str) else serving.tm.tokenizer.decode(list(req.input_ids))


async def _final_outputs(serving: OpenAIServing, request: Request, reqs: list):
    """Every prompt's outputs, in order, or the first error (the others are aborted)."""
    return await final_outputs(request, [functools.partial(serving.tm.generate_request, r) for r in reqs])


def _choice(serving: OpenAIServing, job: CompletionJob, k: int, j: int, out: dict) -> CompletionChoice:
    meta, echo = out["meta_info"], job.echo_texts[k]
    reason, matched = _finish(meta["finish_reason"])
    logprobs = None
    if job.want_logprobs:
        logprobs = completion_logprobs(meta, out["output_ids"], serving.token_texts, text_offset=len(echo or ""))
        if echo is not None:
            logprobs = joined(prompt_logprobs(meta, serving.token_texts), logprobs)
    return CompletionChoice(index=k * job.n + j, text=(echo or "") + out["text"], logprobs=logprobs,
                            finish_reason=reason, matched_stop=matched, **structured_output(meta))


def _batch_usage(groups: list[list[dict]]) -> UsageInfo:
    """Every prompt once, every choice's completion."""
    us = [usage_of(outs) for outs in groups]
    p, c = sum(u.prompt_tokens for u in us), sum(u.completion_tokens for u in us)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in us)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


@dataclass
class _EchoStream(ChoiceStream):
    echoed: bool = False  # the prompt (and its logprobs) went out with an earlier chunk


async def _stream(serving: OpenAIServing, job: CompletionJob, include_usage: bool) -> AsyncIterator[str]:
    created, n = int(time.time()), job.n

    def chunk(choices, usage=None) -> str:
        return sse(CompletionResponse(id=job.response_id, created=created, model=job.model,
                                      choices=choices, usage=usage))

    async def events():
        streams = [_EchoStream(None) for _ in range(len(job.reqs) * n)]
        finals: dict[int, dict] = {}
        async for k, (j, out) in merge_samples([choice_outputs(serving.tm, r) for r in job.reqs]):
            if isinstance(out, str):  # aborted: the error event ends the stream (and the others)
                yield out
                break
            c = k * n + j
            piece = _stream_choice(serving, job, streams[c], k, c, out)
            if piece is not None:
                yield chunk([piece])
            if out["meta_info"]["finish_reason"] is not None:
                finals[c] = out
        if include_usage and len(finals) == len(streams):
            groups = [[finals[k * n + j] for j in range(n)] for k in range(len(job.reqs))]
            yield chunk([], usage=_batch_usage(groups))

    async for event in errors_as_events(events()):
        yield event
    yield SSE_DONE


def _stream_choice(serving: OpenAIServing, job: CompletionJob, st: _EchoStream, k: int, index: int,
                   out: dict) -> Optional[CompletionChoice]:
    """The next chunk of one streamed choice (None if it has nothing new). With ``echo``
    its first chunk carries the prompt (once the prompt's logprobs are in, when asked)."""
    meta, echo = out["meta_info"], job.echo_texts[k]
    fr = meta["finish_reason"]
    prefix, prompt_lps = "", None
    if echo is not None and not st.echoed and (
            not job.want_logprobs or meta.get("input_token_logprobs") is not None or fr is not None):
        prefix, st.echoed = echo, True
        prompt_lps = prompt_logprobs(meta, serving.token_texts) if job.want_logprobs else None
    logprobs = None
    if job.want_logprobs:
        start = len(echo or "") + len(st.sent)
        logprobs = completion_logprobs(meta, out["output_ids"], serving.token_texts, st.logprobs_sent,
                                       text_offset=start)
        st.logprobs_sent += len(logprobs.tokens)
        logprobs = joined(prompt_lps, logprobs) if prompt_lps is not None else logprobs
        logprobs = logprobs if logprobs.tokens else None
    delta, st.sent = out["text"][len(st.sent):], out["text"]
    if not (prefix or delta or fr is not None or logprobs is not None):
        return None
    reason, matched = _finish(fr)
    return CompletionChoice(index=index, text=prefix + delta, logprobs=logprobs, finish_reason=reason,
                            matched_stop=matched, **structured_output(meta))
