"""Frontend half of the engine (runs in the HTTP process).

Validates and tokenizes requests (generate_input.py), sends them to the entry scheduler
rank over ZMQ, and routes the scheduler's ``BatchTokenOut`` messages to one asyncio queue
per request, where they are detokenized into SGLang-shaped output dicts.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

import zmq

from constrained.grammar_config import THINK_END_TOKENS
from constrained.schema_coverage import GrammarReport
from srt.frontend.detokenizer import DecodeState
from srt.frontend.document_check import DocumentChecker
from srt.function_call.format_choice import format_for
from srt.frontend.logprob_output import LogprobAccumulator
from srt.frontend.samples import merge_samples, split_samples
from srt.frontend.dp_dispatch import DPDispatcher
from srt.frontend.generate_input import GenerateReqInput, prepare_request
from srt.transport.io_struct import (
    FRONTEND_INPUT_CODEC, SCHEDULER_INPUT_CODEC, AbortReq, FinishReason, FlushCacheOut, FlushCacheReq, PortArgs, SchedulerInfo,
    TokenizedGenerateReq,
)
from srt.transport.loop_reader import LoopReader
from srt.transport.wire import DropCounter, WireError
from srt.transport.zmq_transport import transport_for
from srt.process_utils import lowest_cpu_priority
from srt.metrics.frontend import create_frontend_metrics
from srt.metrics.messages import SchedulerMetrics
from srt.tokenizer_utils import max_chars_per_token

logger = logging.getLogger(__name__)
# Texts longer than this are tokenized (and chat-templated) off the event loop.
OFFLOOP_CHARS = 16384

__all__ = ["GenerateReqInput", "TokenizerManager"]


@dataclass
class _ReqState:
    req: TokenizedGenerateReq
    decode: DecodeState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    fast_forward_tokens: int = 0
    spec_verify_ct: Optional[int] = None  # decode steps, with speculative decoding on
    finish_reason: Optional[FinishReason] = None
    dp_rank: int = 0  # the DP group serving it: aborts must go to the same group
    logprobs: Optional[LogprobAccumulator] = None  # when the request asked for them
    metrics: Any = None  # a RequestTimer (srt/metrics) with --enable-metrics
    grammar: Optional[GrammarReport] = None  # what served its constraint (with the final output)
    violation: Optional[dict] = None  # its document broke the schema (SchemaViolation.to_json())


class TokenizerManager:
    def __init__(self, server_args, port_args: PortArgs, scheduler_info: SchedulerInfo, tokenizer,
                 scheduler_input_addrs: Optional[tuple[str, ...]] = None):
        """``scheduler_input_addrs``: each DP group's request address as its entry rank
        reported it (default: the IPC endpoints of ``port_args``)."""
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = scheduler_info
        self.tokenizer = tokenizer
        self.context_len = scheduler_info.context_len
        self.max_token_chars = max_chars_per_token(tokenizer)
        # IPC in a private directory, or CURVE-authenticated TCP (multi-node).
        self.transport = transport_for(port_args, server_args.cluster_secret_file, "frontend")
        # Sends are plain (sync) zmq: with an unlimited HWM a PUSH never blocks, so they
        # can run from finally-blocks of cancelled tasks (client disconnects) too.
        # One PUSH per DP group: a connecting PUSH queues until the peer is there.
        addrs = scheduler_input_addrs or port_args.scheduler_input_ipcs
        self._flush_waiters: dict[str, asyncio.Future] = {}
        self._sends = []
        for addr in addrs:
            sock = self.transport.connect(zmq.PUSH, addr)
            sock.setsockopt(zmq.SNDHWM, 0)
            self._sends.append(sock)
        self.dispatcher = DPDispatcher(len(self._sends), getattr(
            server_args, "load_balance_method", "round_robin"))
        self._recv, _ = self.transport.bind(zmq.PULL, port_args.frontend_input_ipc)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._reader = LoopReader(self._recv, self._on_message)
        self.recv_drops = DropCounter("frontend output socket")
        self.rid_to_state: dict[str, _ReqState] = {}
        self.sample_groups: dict[str, list[str]] = {}  # n > 1: request id -> its samples' ids
        self._handle_task: Optional[asyncio.Task] = None
        self.num_aborted = 0  # requests this frontend aborted (client gone), for server info
        self.metrics = create_frontend_metrics(server_args)  # None unless --enable-metrics
        # Schemas are checked (and strict decided) before a request is sent, and finished
        # documents validated here: off the schedulers' step loop (document_check.py).
        self.documents = DocumentChecker(
            server_args, THINK_END_TOKENS.get(getattr(server_args, "reasoning_parser", None) or ""))
        format_for(server_args, tokenizer)  # the tool-call format, decided (and logged) at start
        # Large requests' parsing, templating, tokenizing and schema work: threads at the
        # lowest CPU priority, so the cores go to the step loop and small requests first.
        self.large_work = ThreadPoolExecutor(2, thread_name_prefix="large-request",
                                             initializer=lowest_cpu_priority)
        # Set by the launcher so /health can report dead scheduler processes.
        self.scheduler_alive: Callable[[], bool] = lambda: True

    def prepare_request(self, obj: GenerateReqInput) -> TokenizedGenerateReq:
        """Validate and tokenize; every user error is a ValueError raised here, before
        anything reaches the scheduler (or a stream's first byte)."""
        req = prepare_request(obj, self.tokenizer, self.scheduler_info,
                              enable_custom_logit_processor=self.server_args.enable_custom_logit_processor,
                              grammar_backend=self.server_args.grammar_backend,
                              max_token_chars=self.max_token_chars,
                              reasoning_parser=getattr(self.server_args, "reasoning_parser", None))
        try:  # what the wire cannot carry (an integer past 64 bits, ...) is the user's error
            SCHEDULER_INPUT_CODEC.encode(req)
        except OverflowError:
            raise ValueError("An integer in the request (in custom_params, say) is outside "
                             "the 64-bit range: integers must be in [-2**63, 2**64).") from None
        except (TypeError, ValueError):
            raise ValueError("The request holds a value that cannot be sent to the scheduler: "
                             "strings must be valid Unicode (no lone surrogates) and values "
                             "plain JSON.") from None
        self.documents.check_request(req.sampling_params)
        self.check_new_rid(req.rid)
        return req

    def check_new_rid(self, rid: str) -> None:
        if rid in self.rid_to_state or rid in self.sample_groups:
            raise ValueError(f"Duplicate request id {rid!r}: it is still running.")

    async def prepare_request_async(self, obj: GenerateReqInput) -> TokenizedGenerateReq:
        """``prepare_request``; a large text (tokenized) or any schema given as an object (its
        validator built) is prepared on a worker thread, so other requests' streams and
        admissions go on meanwhile."""
        schema = (obj.sampling_params or {}).get("json_schema")  # its validator is built here
        size = len(obj.text or "") + (len(schema) if isinstance(schema, str) else 0 if schema is None
                                      else OFFLOOP_CHARS + 1)  # an object: size unknown until dumped
        if size > OFFLOOP_CHARS:
            return await self.offload(self.prepare_request, obj)
        return self.prepare_request(obj)

    async def offload(self, fn: Callable, *args):
        """``fn(*args)`` on a large-request thread (lowest CPU priority)."""
        return await asyncio.get_running_loop().run_in_executor(self.large_work, fn, *args)

    # ---- request lifecycle --------------------------------------------------------
    async def generate_request(
        self, obj: Union[GenerateReqInput, TokenizedGenerateReq]
    ) -> AsyncIterator[dict]:
        """Yield output dicts (cumulative text/output_ids): one per received chunk when
        streaming, else one at the end. Closing the generator early aborts the request."""
        req = obj if isinstance(obj, TokenizedGenerateReq) else self.prepare_request(obj)
        if req.sampling_params.n > 1:
            async for out in self._generate_samples(req):
                yield out
            return
        if req.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request id {req.rid!r}: it is still running.")
        self.start_handle_loop()
        p = req.sampling_params
        state = _ReqState(req, DecodeState(self.tokenizer, req.input_ids, p.stop, p.skip_special_tokens))
        state.prompt_tokens = len(req.input_ids)
        if req.logprobs is not None:
            state.logprobs = LogprobAccumulator(req.logprobs, req.input_ids)
        state.dp_rank = self.dispatcher.pick(req.input_ids, req.prefix_group)
        self.rid_to_state[req.rid] = state
        try:
            self._send(state.dp_rank, req)
            if self.metrics is not None:
                state.metrics = self.metrics.start_request(req)
            while True:
                chunks = [await state.queue.get()]
                while not state.queue.empty():  # coalesce when the consumer is slower
                    chunks.append(state.queue.get_nowait())
                for chunk in chunks:
                    self._apply(state, *chunk)
                if state.grammar is not None and state.finish_reason is not None:
                    await self._check_document(state)
                if state.finish_reason is not None or req.stream:
                    yield self._make_output(state)
                if state.finish_reason is not None:
                    return
        finally:
            self.rid_to_state.pop(req.rid, None)
            self.dispatcher.done(state.dp_rank, req.prefix_group)
            if state.finish_reason is None:  # consumer went away (disconnect, cancel, error)
                self.num_aborted += 1
                if state.metrics is not None:
                    state.metrics.on_client_abort()
                with contextlib.suppress(zmq.ZMQError):  # already closed at shutdown
                    self._send(state.dp_rank, AbortReq(req.rid))

    async def _generate_samples(self, req: TokenizedGenerateReq) -> AsyncIterator[Any]:
        """n > 1 (samples.py): streaming yields each sample's outputs with its ``index``;
        otherwise one list of the n final outputs, in index order."""
        parts = split_samples(req)
        for part in parts:
            self.check_new_rid(part.rid)
        self.sample_groups[req.rid] = [p.rid for p in parts]
        try:
            finals: dict[int, dict] = {}
            async with contextlib.aclosing(merge_samples([self.generate_request(p) for p in parts])) as outs:
                async for i, out in outs:
                    out["index"] = i
                    if req.stream:
                        yield out
                    elif out["meta_info"]["finish_reason"] is not None:
                        finals[i] = out
            if not req.stream:
                yield [finals[i] for i in range(len(parts))]
        finally:
            self.sample_groups.pop(req.rid, None)

    def abort_request(self, rid: str, message: Optional[str] = None, status_code: Optional[int] = None) -> None:
        """Ask the scheduler to abort ``rid`` (every sample, for an n > 1 request); it
        answers with an abort finish reason carrying ``message`` and ``status_code``, the
        HTTP status its answer gets (200: the partial output, see ``AbortReq``)."""
        fields = {k: v for k, v in (("message", message), ("status_code", status_code)) if v is not None}
        for part in self.sample_groups.get(rid, [rid]):
            state = self.rid_to_state.get(part)
            if state is not None:
                self._send(state.dp_rank, AbortReq(part, **fields))

    def fail_all(self, message: str, status_code: int = 503) -> int:
        """End every in-flight request from here, without waiting for a scheduler (the server
        is stopping, or a rank is gone): each gets an abort finish reason with ``message``
        (a stream: its error event), and the schedulers are told to drop it. Returns how
        many requests were ended."""
        ended = 0
        for rid, state in list(self.rid_to_state.items()):
            if state.finish_reason is not None:
                continue
            reason = FinishReason("abort", message=message, status_code=status_code)
            state.queue.put_nowait(((), reason, None, None))  # None: keep the token counts
            with contextlib.suppress(zmq.ZMQError):
                self._send(state.dp_rank, AbortReq(rid, message, status_code))
            ended += 1
        return ended

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheOut:
        """Ask every DP group to empty its radix cache; success only if all of them did."""
        loop = asyncio.get_running_loop()
        rids = [f"flush-{uuid.uuid4().hex}" for _ in self._sends]
        waiters = [loop.create_future() for _ in rids]
        self._flush_waiters.update(zip(rids, waiters))
        try:
            for dp_rank, rid in enumerate(rids):
                self._send(dp_rank, FlushCacheReq(rid))
            replies = await asyncio.wait_for(asyncio.gather(*waiters), timeout)
        except asyncio.TimeoutError:
            return FlushCacheOut("", False, f"No answer from the scheduler within {timeout:.0f} s.")
        finally:
            for rid in rids:
                self._flush_waiters.pop(rid, None)
        failed = [r for r in replies if not r.success]
        return failed[0] if failed else replies[0]

    def _send(self, dp_rank: int, msg) -> None:
        self._sends[dp_rank].send(SCHEDULER_INPUT_CODEC.encode(msg), copy=False)

    def _apply(self, state: _ReqState, new_ids, reason, prompt_tokens, completion_tokens,
               cached_tokens=0, fast_forward_tokens=0, spec_verify_ct=None, output_logprobs=None,
               input_logprobs=None, grammar_report=None) -> None:
        new_ids = list(new_ids)
        state.output_ids.extend(new_ids)
        if prompt_tokens is not None:  # None: ended by the frontend (fail_all), counts unchanged
            state.prompt_tokens, state.completion_tokens = prompt_tokens, completion_tokens
            state.cached_tokens = cached_tokens
            state.fast_forward_tokens = fast_forward_tokens
            state.spec_verify_ct = spec_verify_ct
        if state.logprobs is not None:
            state.logprobs.add(output_logprobs, input_logprobs)
        text_ids = new_ids
        if reason is not None:
            state.finish_reason = reason
            m = reason.matched
            # A matched EOS / stop token id is counted but not shown (SGLang).
            if _is_int(m) and new_ids and new_ids[-1] == m:
                text_ids = new_ids[:-1]
        state.decode.add_tokens(text_ids, flush=reason is not None)
        if grammar_report is not None:  # comes with the final output: generate_request checks it
            state.grammar = grammar_report

    async def _check_document(self, state: _ReqState) -> None:
        """The finished output's JSON documents against their full schemas (document_check.py);
        a long output is validated on a large-request thread, off the event loop."""
        reason = state.finish_reason
        matched = reason.matched if isinstance(reason.matched, str) else None
        params = state.req.sampling_params
        args = (params, state.grammar, reason, state.decode.visible_text(True, matched), state.req.require_reasoning)
        if len(args[3]) > OFFLOOP_CHARS:
            violation, _ = await self.offload(self.documents.check_finished, *args)
        else:
            violation, _ = self.documents.check_finished(*args)
        state.violation = violation
        if self.metrics is not None and (params.json_schema or params.structural_tag) is not None:
            self.metrics.on_validated(state.grammar.backend, not state.grammar.exact, violation is not None)

    def _make_output(self, state: _ReqState) -> dict:
        reason = state.finish_reason
        matched = reason.matched if reason is not None and isinstance(reason.matched, str) else None
        fr = None
        if reason is not None:
            fr = reason.to_json()
            if reason.type == "abort":
                fr["status_code"] = reason.status_code  # SGLang includes it too
            if state.violation is not None:  # never reported as a success (docs/constrained.md)
                fr = {"type": "schema_violation", "matched": fr.get("matched"), **state.violation}
        out = {
            "text": state.decode.visible_text(reason is not None, matched),
            "output_ids": list(state.output_ids),
            "meta_info": {
                "id": state.req.rid,
                "prompt_tokens": state.prompt_tokens,
                "completion_tokens": state.completion_tokens,
                "cached_tokens": state.cached_tokens,
                "fast_forward_tokens": state.fast_forward_tokens,
                "finish_reason": fr,
            },
        }
        if state.spec_verify_ct is not None:  # SGLang's names; accept length: tokens per step
            out["meta_info"]["spec_verify_ct"] = state.spec_verify_ct
            decoded = state.completion_tokens - 1  # the first token comes from the prefill
            out["meta_info"]["spec_accept_length"] = (
                round(decoded / state.spec_verify_ct, 3) if state.spec_verify_ct else None)
        if state.grammar is not None:
            out["meta_info"]["grammar"] = state.grammar.to_json()
        if state.logprobs is not None:
            out["meta_info"].update(state.logprobs.meta_info(state.output_ids, self.tokenizer))
        return out

    # ---- receive loop -------------------------------------------------------------
    def start_handle_loop(self) -> None:
        """Start the receive task in the running loop (idempotent)."""
        if self._handle_task is None or self._handle_task.done():
            self._handle_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        await self._reader.run()  # each message: _on_message, on this loop

    def _on_message(self, data: bytes) -> None:
        try:
            out = FRONTEND_INPUT_CODEC.decode(data)
        except WireError as e:  # not a valid message: dropped and counted
            self.recv_drops.dropped(e, len(data))
            return
        self._dispatch(out)

    def _dispatch(self, out) -> None:
        """One scheduler output: its requests' new tokens to their queues."""
        if isinstance(out, SchedulerMetrics):  # a DP group's state (--enable-metrics)
            if self.metrics is not None:
                self.metrics.on_scheduler_metrics(out)
            return
        if isinstance(out, FlushCacheOut):
            waiter = self._flush_waiters.get(out.rid)
            if waiter is not None and not waiter.done():
                waiter.set_result(out)
            return
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is not None:  # else: already gone (aborted by us)
                state.queue.put_nowait((
                    out.new_token_ids[i], out.finished_reasons[i],
                    out.prompt_tokens[i], out.completion_tokens[i],
                    out.cached_tokens[i] if out.cached_tokens else 0,
                    out.fast_forward_tokens[i] if out.fast_forward_tokens else 0,
                    out.spec_verify_ct[i] if out.spec_verify_ct else None,
                    out.output_logprobs[i] if out.output_logprobs else None,
                    out.input_logprobs[i] if out.input_logprobs else None,
                    out.grammar_reports[i] if out.grammar_reports else None,
                ))
                if state.metrics is not None:
                    state.metrics.on_output(out.finished_reasons[i], out.prompt_tokens[i], out.completion_tokens[i],
                                            out.cached_tokens[i] if out.cached_tokens else 0)

    @property
    def handle_task(self) -> Optional[asyncio.Task]:
        return self._handle_task

    def close(self) -> None:
        self.large_work.shutdown(wait=False, cancel_futures=True)
        self._reader.stop()  # before its socket closes
        if self._handle_task is not None:
            self._handle_task.cancel()
        self.transport.close()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
