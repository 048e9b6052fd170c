"""Frontend half of the engine (runs in the HTTP process).

Validates and tokenizes requests (generate_input.py), sends them to the entry scheduler
rank over ZMQ, and routes the scheduler's ``BatchTokenOut`` messages to one asyncio queue
per request, where they are detokenized into SGLang-shaped output dicts.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

import zmq
import zmq.asyncio

from srt.managers.detokenizer import DecodeState
from srt.managers.dp_dispatch import DPDispatcher
from srt.managers.generate_input import GenerateReqInput, prepare_request
from srt.managers.io_struct import (
    AbortReq, BatchTokenOut, FinishReason, PortArgs, SchedulerInfo, TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)

__all__ = ["GenerateReqInput", "TokenizerManager"]


@dataclass
class _ReqState:
    req: TokenizedGenerateReq
    decode: DecodeState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[FinishReason] = None
    dp_rank: int = 0  # the DP group serving it: aborts must go to the same group


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
        # Sends are plain (sync) zmq: with an unlimited HWM a PUSH never blocks, so they
        # can run from finally-blocks of cancelled tasks (client disconnects) too.
        self._sync_ctx = zmq.Context()
        # One PUSH per DP group: a connecting PUSH queues until the peer is there.
        addrs = scheduler_input_addrs or port_args.scheduler_input_ipcs
        self._sends = []
        for addr in addrs:
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            self._sends.append(sock)
        self.dispatcher = DPDispatcher(len(self._sends), getattr(
            server_args, "load_balance_method", "round_robin"))
        self._async_ctx = zmq.asyncio.Context()
        self._recv = self._async_ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(port_args.frontend_input_ipc)
        self.rid_to_state: dict[str, _ReqState] = {}
        self._handle_task: Optional[asyncio.Task] = None
        self.num_aborted = 0  # requests this frontend aborted (client gone), for server info
        # Set by the launcher so /health can report dead scheduler processes.
        self.scheduler_alive: Callable[[], bool] = lambda: True

    def prepare_request(self, obj: GenerateReqInput) -> TokenizedGenerateReq:
        """Validate and tokenize; every user error is a ValueError raised here, before
        anything reaches the scheduler."""
        return prepare_request(obj, self.tokenizer, self.scheduler_info,
                               enable_custom_logit_processor=self.server_args.enable_custom_logit_processor,
                               grammar_backend=self.server_args.grammar_backend)

    # ---- request lifecycle --------------------------------------------------------
    async def generate_request(
        self, obj: Union[GenerateReqInput, TokenizedGenerateReq]
    ) -> AsyncIterator[dict]:
        """Yield output dicts (cumulative text/output_ids): one per received chunk when
        streaming, else one at the end. Closing the generator early aborts the request."""
        req = obj if isinstance(obj, TokenizedGenerateReq) else self.prepare_request(obj)
        if req.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request id {req.rid!r}: it is still running.")
        self.start_handle_loop()
        p = req.sampling_params
        state = _ReqState(req, DecodeState(self.tokenizer, req.input_ids, p.stop, p.skip_special_tokens))
        state.prompt_tokens = len(req.input_ids)
        state.dp_rank = self.dispatcher.pick()
        self.rid_to_state[req.rid] = state
        try:
            self._sends[state.dp_rank].send_pyobj(req)
            while True:
                chunks = [await state.queue.get()]
                while not state.queue.empty():  # coalesce when the consumer is slower
                    chunks.append(state.queue.get_nowait())
                for chunk in chunks:
                    self._apply(state, *chunk)
                if state.finish_reason is not None or req.stream:
                    yield self._make_output(state)
                if state.finish_reason is not None:
                    return
        finally:
            self.rid_to_state.pop(req.rid, None)
            self.dispatcher.done(state.dp_rank)
            if state.finish_reason is None:  # consumer went away (disconnect, cancel, error)
                self.num_aborted += 1
                with contextlib.suppress(zmq.ZMQError):  # already closed at shutdown
                    self._sends[state.dp_rank].send_pyobj(AbortReq(req.rid))

    def abort_request(self, rid: str) -> None:
        """Ask the scheduler to abort ``rid``; it answers with an abort finish reason."""
        state = self.rid_to_state.get(rid)
        if state is not None:
            self._sends[state.dp_rank].send_pyobj(AbortReq(rid))

    def _apply(self, state: _ReqState, new_ids, reason, prompt_tokens, completion_tokens) -> None:
        new_ids = list(new_ids)
        state.output_ids.extend(new_ids)
        state.prompt_tokens, state.completion_tokens = prompt_tokens, completion_tokens
        text_ids = new_ids
        if reason is not None:
            state.finish_reason = reason
            m = reason.matched
            # A matched EOS / stop token id is counted but not shown (SGLang).
            if _is_int(m) and new_ids and new_ids[-1] == m:
                text_ids = new_ids[:-1]
        state.decode.add_tokens(text_ids, flush=reason is not None)

    @staticmethod
    def _make_output(state: _ReqState) -> dict:
        reason = state.finish_reason
        matched = reason.matched if reason is not None and isinstance(reason.matched, str) else None
        fr = None
        if reason is not None:
            fr = reason.to_json()
            if reason.type == "abort":
                fr["status_code"] = reason.status_code  # SGLang includes it too
        return {
            "text": state.decode.visible_text(reason is not None, matched),
            "output_ids": list(state.output_ids),
            "meta_info": {
                "id": state.req.rid,
                "prompt_tokens": state.prompt_tokens,
                "completion_tokens": state.completion_tokens,
                "finish_reason": fr,
            },
        }

    # ---- receive loop -------------------------------------------------------------
    def start_handle_loop(self) -> None:
        """Start the receive task in the running loop (idempotent)."""
        if self._handle_task is None or self._handle_task.done():
            self._handle_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            try:
                out = await self._recv.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                if self._recv.closed:  # close() ran: nothing more will arrive
                    return
                logger.exception("Failed to receive from the scheduler")
                continue
            except Exception:  # a bad message must not kill every request's stream
                logger.exception("Failed to receive from the scheduler")
                continue
            if not isinstance(out, BatchTokenOut):
                logger.warning("Ignoring unexpected message from the scheduler: %r", type(out))
                continue
            for i, rid in enumerate(out.rids):
                state = self.rid_to_state.get(rid)
                if state is not None:  # else: already gone (aborted by us)
                    state.queue.put_nowait((
                        out.new_token_ids[i], out.finished_reasons[i],
                        out.prompt_tokens[i], out.completion_tokens[i],
                    ))

    @property
    def handle_task(self) -> Optional[asyncio.Task]:
        return self._handle_task

    def close(self) -> None:
        if self._handle_task is not None:
            self._handle_task.cancel()
        self._recv.close(0)
        for sock in self._sends:
            sock.close(0)
        self._async_ctx.term()
        self._sync_ctx.term()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
