"""Graceful drain of the HTTP frontend (docs/multi-rank.md "Graceful shutdown").

SIGTERM: new requests (and /health) get 503 with ``SHUTTING_DOWN``; the requests already
being served run on for up to ``--graceful-shutdown-timeout`` seconds; the rest are then
ended from here (``TokenizerManager.fail_all``: a stream gets its error event, a
non-streaming request a 503); then uvicorn stops and the launcher stops the ranks. SIGINT,
or a rank that died, does the same with no waiting. The scheduler ranks ignore the signal
meanwhile (``srt/process_utils.py`` ``defer_stop_signals``): the frontend decides.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable, Optional

from srt.entrypoints.openai_protocol import error_body

logger = logging.getLogger(__name__)

SHUTTING_DOWN = "The server is shutting down; retry on another replica."
RANK_GONE = "A scheduler process has exited, so the server is stopping; retry on another replica."
FLUSH_S = 5.0  # after ending the requests: time for their last events to go out
POLL_S = 0.05
OPEN_WHILE_DRAINING = frozenset({"/metrics"})  # scrapes still see the drain


class Drain:
    """The frontend's shutdown state; runs on the server's event loop."""

    def __init__(self, tokenizer_manager, timeout_s: float):
        self.tm = tokenizer_manager
        self.timeout_s = timeout_s
        self.message: Optional[str] = None  # set: new requests are refused with it (503)
        self.active = 0  # HTTP requests being served (a stream until its last byte is sent)
        self.on_done: Callable[[], None] = lambda: None  # stop the HTTP server
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._deadline: Optional[float] = None
        self._abort_message = SHUTTING_DOWN
        self._task: Optional[asyncio.Task] = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    # ---- from signal handlers and other threads --------------------------------------
    def on_signal(self, signum: int) -> None:
        """SIGTERM: drain for --graceful-shutdown-timeout; SIGINT: end everything now."""
        if signum == signal.SIGTERM:
            self.request(SHUTTING_DOWN, self.timeout_s,
                         "The server is shutting down and the request did not finish within "
                         f"--graceful-shutdown-timeout ({self.timeout_s:g} s); retry on another replica.")
        else:
            self.request(SHUTTING_DOWN, 0.0, SHUTTING_DOWN)

    def request(self, message: str, timeout_s: float, abort_message: Optional[str] = None) -> None:
        """Start (or hurry) the drain from any thread; before the server runs: stop it."""
        loop = self.loop
        if loop is None or loop.is_closed():
            self.on_done()
            return
        loop.call_soon_threadsafe(self.begin, message, timeout_s, abort_message or message)

    # ---- on the event loop -------------------------------------------------------------
    def begin(self, message: str, timeout_s: float, abort_message: str) -> None:
        if self.message is None:
            self.message = message
        deadline = time.monotonic() + timeout_s
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
            self._abort_message = abort_message
        if self._task is None:
            logger.warning("Shutting down: refusing new requests; %d in flight, waiting up to "
                           "%.1f s for them", self.active, max(timeout_s, 0.0))
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.active and time.monotonic() < self._deadline:
                await asyncio.sleep(POLL_S)
            if self.active:
                logger.warning("Ending %d request(s) still in flight: %s", self.active, self._abort_message)
                flush_until = time.monotonic() + FLUSH_S
                while self.active and time.monotonic() < flush_until:
                    self.tm.fail_all(self._abort_message, 503)  # again: late arrivals too
                    await asyncio.sleep(POLL_S)
            logger.info("Drained; stopping the HTTP server")
        finally:
            self.on_done()


class DrainGate:
    """Pure ASGI middleware: counts the requests being served and refuses new ones (503,
    ``Connection: close``) once the drain has begun."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        drain = self.drain
        if drain.message is not None and scope.get("path") not in OPEN_WHILE_DRAINING:
            from fastapi.responses import JSONResponse

            reply = JSONResponse(error_body(drain.message, 503), status_code=503,
                                 headers={"Connection": "close", "Retry-After": "1"})
            return await reply(scope, receive, send)
        drain.active += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            drain.active -= 1
