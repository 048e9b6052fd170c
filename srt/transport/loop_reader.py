"""A ZMQ socket's messages handed to a callback on the running asyncio loop.

zmq.asyncio makes a Future per ``recv``, and its readiness checks (EVENTS flags, fork
checks) run in Python every message, on cores the scheduler's step needs (the frontend's
CPU per streamed token fell a little with this reader: 0.43-0.57 -> 0.47-0.53 ms on a
2-vCPU Xeon, within its noise; docs/architecture.md). Here the socket's FD is
watched once (``loop.add_reader``) and a readable wake drains every queued message with
non-blocking receives, calling ``on_message(bytes)`` for each.

ZMQ's FD is edge-triggered: it signals a change, not "messages are queued". So a wake
reads until ``zmq.Again`` (then the next message signals again), and a drain that stops
early to let other tasks run schedules its own continuation.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import zmq

logger = logging.getLogger(__name__)

MAX_MESSAGES_PER_WAKE = 256  # then yield to the loop (other streams, new requests)


class LoopReader:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[bytes], None]):
        self.sock = sock
        self.on_message = on_message
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._fd: Optional[int] = None

    async def run(self) -> None:
        """Deliver messages until cancelled (the task is the reader's lifetime)."""
        self._loop = asyncio.get_running_loop()
        self._fd = self.sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        try:
            self._drain()  # what arrived before the FD was watched signals nothing more
            await self._loop.create_future()
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop watching the FD (idempotent; before the socket closes)."""
        if self._fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._fd = None

    def _drain(self) -> None:
        if self._fd is None or self.sock.closed:
            return
        for _ in range(MAX_MESSAGES_PER_WAKE):
            try:
                data = self.sock.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError:
                if self.sock.closed:
                    return
                logger.exception("Failed to receive from %s", self.sock)
                continue
            try:
                self.on_message(data)
            except Exception:  # one bad message must not stop every other stream
                logger.exception("Failed to handle a message")
        self._loop.call_soon(self._drain)  # more may be queued: the FD will not say so
