"""Where each rank's iteration inputs come from, and where its outputs go.

The entry rank drains its ZMQ socket (blocking briefly when idle); at TP > 1 it then
broadcasts the list over the TP CPU group (``broadcast_pyobj``), so every rank handles
identical messages in the same iteration. Only the entry rank talks to the frontend.
"""
from __future__ import annotations

import socket
from typing import Optional

import zmq

from distributed.broadcast import broadcast_pyobj
from distributed.parallel_state import RankInfo, TPGroup
from srt import environ


class RequestReceiver:
    def __init__(self, ctx: zmq.Context, endpoint: str, rank_info: RankInfo, tp: TPGroup,
                 advertise_host: Optional[str] = None):
        self.rank_info = rank_info
        self.tp = tp
        self.sock = None
        self.address: Optional[str] = None  # entry rank: where the frontend must connect
        if rank_info.is_entry_rank:
            self.sock = ctx.socket(zmq.PULL)
            self.sock.setsockopt(zmq.LINGER, 0)
            if endpoint.endswith(":0"):  # TCP, any free port: report the one we got
                port = self.sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
                self.address = f"tcp://{advertise_host or reachable_ip()}:{port}"
            else:
                self.sock.bind(endpoint)
                self.address = endpoint
        # The first rank of the group is the broadcast source (world rank numbering).
        self.src_world_rank = rank_info.world_rank - rank_info.tp_rank
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
        if self.tp.is_single:
            return msgs
        return broadcast_pyobj(msgs, self.rank_info.is_entry_rank, self.src_world_rank,
                               self.tp.cpu_group)


class OutputSender:
    """Entry rank only: pushes BatchTokenOut to the frontend; other ranks drop outputs."""

    def __init__(self, ctx: zmq.Context, endpoint: str, rank_info: RankInfo):
        self.sock = None
        if rank_info.is_entry_rank:
            self.sock = ctx.socket(zmq.PUSH)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(endpoint)

    def send(self, out) -> None:
        if self.sock is not None:
            self.sock.send_pyobj(out)


def reachable_ip(peer: str) -> str:
    """This host's address on the interface that routes to ``peer`` (node 0; a UDP
    "connect" only picks the route and sends nothing); falls back to the hostname's."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
