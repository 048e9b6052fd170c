"""A FAKE scheduler endpoint, standing in for the real one ONLY in frontend unit tests.

It speaks the real ZMQ protocol (io_struct messages in the real wire codec, same socket roles as the entry
rank: bind PULL on scheduler_input_ipc, connect PUSH to frontend_input_ipc) but runs no
model: each request "generates" a fixed token script, one token per step. It honours
max_new_tokens, stop strings, stop_token_ids / EOS and aborts like the real scheduler
promises to, and records what it received so tests can assert on aborts. A request with
max_new_tokens == ABORT_MAGIC is aborted by the "scheduler" itself after 3 tokens (as a
timeout would be), with status 503.
"""
from __future__ import annotations

import threading
import time

import zmq

from srt.transport.io_struct import (
    FRONTEND_INPUT_CODEC, SCHEDULER_INPUT_CODEC, AbortReq, BatchTokenOut, FinishReason, PortArgs, SchedulerInfo, TokenizedGenerateReq,
)


ABORT_MAGIC = 777


class FakeScheduler:
    def __init__(self, port_args: PortArgs, tokenizer, script_ids, eos_id: int,
                 step_delay: float = 0.002, info: SchedulerInfo | None = None):
        self.port_args = port_args
        self.tokenizer = tokenizer
        self.script = list(script_ids)
        self.eos_id = eos_id
        self.step_delay = step_delay
        self.info = info
        self.received: list = []  # every message, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "FakeScheduler":
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def aborted_rids(self) -> list[str]:
        return [m.rid for m in self.received if isinstance(m, AbortReq)]

    def _run(self) -> None:
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(self.port_args.scheduler_input_ipc)
        push = ctx.socket(zmq.PUSH)
        push.connect(self.port_args.frontend_input_ipc)
        running: dict[str, dict] = {}
        try:
            while not self._stop.is_set():
                while pull.poll(0 if running else 10):
                    msg = SCHEDULER_INPUT_CODEC.decode(pull.recv())
                    self.received.append(msg)
                    if isinstance(msg, TokenizedGenerateReq):
                        running[msg.rid] = {"req": msg, "out": [], "sent": 0}
                    elif isinstance(msg, AbortReq) and msg.rid in running:
                        running[msg.rid]["abort"] = msg
                if running:
                    self._step(running, push)
                    time.sleep(self.step_delay)
        finally:
            pull.close(0)
            push.close(0)
            ctx.term()

    def _step(self, running: dict, push) -> None:
        rids, new, reasons, pts, cts = [], [], [], [], []
        for rid, st in list(running.items()):
            req: TokenizedGenerateReq = st["req"]
            p = req.sampling_params
            reason = None
            if st.get("abort"):
                m = st["abort"]
                reason = FinishReason("abort", message=m.message, status_code=m.status_code)
            elif len(st["out"]) >= p.max_new_tokens:
                reason = FinishReason("length", matched=p.max_new_tokens)
            elif p.max_new_tokens == ABORT_MAGIC and len(st["out"]) == 3:
                reason = FinishReason("abort", message="Fake scheduler timed the request out.", status_code=503)
            else:
                tok = self.script[len(st["out"]) % len(self.script)]
                st["out"].append(tok)
                text = self.tokenizer.decode(st["out"])
                hit = next((s for s in p.stop if s in text), None)
                if hit is not None:
                    reason = FinishReason("stop", matched=hit)
                elif tok in p.stop_token_ids or (tok == self.eos_id and not p.ignore_eos):
                    reason = FinishReason("stop", matched=tok)
                elif len(st["out"]) >= p.max_new_tokens:
                    reason = FinishReason("length", matched=p.max_new_tokens)
            if req.stream or reason is not None:
                start = st["sent"] if req.stream else 0
                rids.append(rid)
                new.append(tuple(st["out"][start:]))
                st["sent"] = len(st["out"])
                reasons.append(reason)
                pts.append(len(req.input_ids))
                cts.append(len(st["out"]))
            if reason is not None:
                del running[rid]
        if rids:
            push.send(FRONTEND_INPUT_CODEC.encode(
                BatchTokenOut(tuple(rids), tuple(new), tuple(reasons), tuple(pts), tuple(cts))))
