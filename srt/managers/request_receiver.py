"""Where each rank's iteration inputs come from.

The entry rank drains its ZMQ socket (blocking briefly when idle); at TP > 1 it then
broadcasts the list over the TP CPU group so every rank handles identical messages in the
same iteration (the multi-rank issue plugs ``broadcast_pyobj`` in here).
"""
from __future__ import annotations

import zmq

from distributed.parallel_state import RankInfo, TPGroup
from srt import environ


class RequestReceiver:
    def __init__(self, ctx: zmq.Context, endpoint: str, rank_info: RankInfo, tp: TPGroup):
        self.rank_info = rank_info
        self.tp = tp
        self.sock = None
        if rank_info.is_entry_rank:
            self.sock = ctx.socket(zmq.PULL)
            self.sock.bind(endpoint)
        self.idle_wait_ms = int(environ.GRAMSYNC_SCHEDULER_IDLE_WAIT.get() * 1000)

    def recv(self, block: bool, extra: list) -> list:
        msgs = []
        if self.sock is not None:
            if block:
                self.sock.poll(self.idle_wait_ms)
            while True:
                try:
                    msgs.append(self.sock.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
            msgs.extend(extra)
        if not self.tp.is_single:
            raise NotImplementedError("TP > 1 arrives with the multi-rank issue")
        return msgs


class OutputSender:
    """Entry rank only: pushes BatchTokenOut to the frontend; other ranks drop outputs."""

    def __init__(self, ctx: zmq.Context, endpoint: str, rank_info: RankInfo):
        self.sock = None
        if rank_info.is_entry_rank:
            self.sock = ctx.socket(zmq.PUSH)
            self.sock.connect(endpoint)

    def send(self, out) -> None:
        if self.sock is not None:
            self.sock.send_pyobj(out)
