"""Kills a scheduler rank whose loop stops making progress (a hung step or collective)."""
from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, timeout: float, log_prefix: str):
        self.timeout = timeout
        self.log_prefix = log_prefix
        self._last = time.monotonic()

    def feed(self) -> None:
        """Called once per scheduler iteration."""
        self._last = time.monotonic()

    def start(self) -> None:
        if self.timeout > 0:
            threading.Thread(target=self._run, daemon=True, name="watchdog").start()

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            stalled = time.monotonic() - self._last
            if stalled > self.timeout:
                logger.error("%s scheduler made no progress for %.0f s (--watchdog-timeout=%s); "
                             "exiting", self.log_prefix, stalled, self.timeout)
                os._exit(1)  # the launcher sees the exit and takes the server down
