"""The OpenAI chat endpoint (/v1/chat/completions) and the request parsing and waiting that
/v1/completions (openai_completions.py) shares with it through ``OpenAIServing``."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from srt.entrypoints.http_common import (
    OFFLOOP_BODY_BYTES, SSE_DONE, error_response, errors_as_events, final_output, read_json, sse,
)
from srt.entrypoints.openai_choices import ChoiceStream, _finish, choice_outputs, structured_output, usage_of
from srt.entrypoints.openai_logprobs import TokenTexts, chat_logprobs
from srt.entrypoints.openai_protocol import ChatCompletionRequest, validation_error_message
from srt.entrypoints.openai_responses import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionResponse, ChatCompletionStreamChoice, ChatMessageOut,
    DeltaMessage,
)
from srt.function_call.serving import ToolCalling
from srt.frontend.generate_input import check_fits_context
from srt.frontend.reasoning_parser import ReasoningSplit
from srt.frontend.tokenizer_manager import OFFLOOP_CHARS, TokenizerManager
from srt.tokenizer_utils import apply_chat_template


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

    async def _final_output(self, request: Request, req) -> tuple[Optional[list], Optional[Response]]:
        """Run a non-streaming request: (its outputs, None), or (None, the error response)."""
        return await final_output(request, self.tm.generate_request(req))

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
        # The thinking goes to reasoning_content; tool calls are parsed from the answer only.
        split = ReasoningSplit.of(self.tm.server_args.reasoning_parser, req.require_reasoning,
                                  body.separate_reasoning)
        if body.stream:
            return StreamingResponse(self._chat_stream(req, model, body.include_usage, tools, bool(body.logprobs),
                                                       split),
                                     media_type="text/event-stream")
        outs, err = await self._final_output(request, req)
        if err is not None:
            return err
        choices = []
        for i, out in enumerate(outs):
            meta = out["meta_info"]
            reason, matched = _finish(meta["finish_reason"])
            reasoning, answer = split.split(out["text"])
            message, reason = tools.message(answer, reason)
            message = split.message(reasoning, message)
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
        ids = apply_chat_template(self.tm.tokenizer, messages, **body.template_flags(),
                                  **(body.chat_template_kwargs or {}), **tool_kwargs)
        obj = body.generate_input(uuid.uuid4().hex, input_ids=ids)
        tools.constrain(obj.sampling_params)  # the tool-call grammar (srt/function_call)
        obj.require_reasoning = body.requires_reasoning(self.tm.server_args.reasoning_parser)
        return obj, tools

    async def _chat_stream(self, req, model: str, include_usage: bool, tools, want_logprobs: bool,
                           split: ReasoningSplit) -> AsyncIterator[str]:
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
        events = self._chat_events(req, chunk, created, model, include_usage, tools, want_logprobs, split)
        async for event in errors_as_events(events):
            yield event
        yield SSE_DONE

    async def _chat_events(self, req, chunk, created: int, model: str, include_usage: bool, tools,
                           want_logprobs: bool, split: ReasoningSplit):
        n = req.sampling_params.n
        validators = self.tm.documents.validators

        def valid(schema: str, arguments: str) -> bool:
            try:
                return validators.validate(schema, arguments) is None
            except ValueError:  # a schema the validator cannot build: never "valid"
                return False

        streams = [ChoiceStream(tools.stream(valid), reasoning=split.parser()) for _ in range(n)]  # per choice
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
                deltas = st.deltas(split, *st.reasoning.feed(out["text"][len(st.sent):]))
                st.sent = out["text"]
            if logprobs is not None and not deltas:
                deltas = [{"content": ""}]  # logprobs of tokens whose text is held back
            for k, delta in enumerate(deltas):
                yield chunk(DeltaMessage(**delta), index=i, logprobs=logprobs if k == 0 else None)
            if fr is not None:
                finals[i] = out
                reason, matched = _finish(fr)
                for delta in st.deltas(split, *st.reasoning.finish()):  # what the parser held back
                    yield chunk(DeltaMessage(**delta), index=i)
                last_deltas, reason = st.tools.finish(reason)
                for delta in last_deltas:
                    yield chunk(DeltaMessage(**delta), index=i)
                yield chunk(DeltaMessage(), reason, matched, index=i, meta=out["meta_info"])
        if include_usage and len(finals) == n:
            yield sse(ChatCompletionChunk(id=f"chatcmpl-{req.rid}", created=created, model=model,
                                          choices=[], usage=usage_of([finals[i] for i in range(n)])))

