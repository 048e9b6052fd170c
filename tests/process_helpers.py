"""Process clean-up shared by the tests that start servers."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def stop_process_group(proc: subprocess.Popen, term_wait: float = 15, kill_wait: float = 5) -> None:
    """SIGTERM the process group started with ``start_new_session=True``, then SIGKILL it
    if it is still there: the frontend and every scheduler rank go down together."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    """``predicate()``'s first truthy value, polled until ``timeout`` seconds (then fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")
