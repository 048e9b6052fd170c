"""Process hygiene shared by every gramsync process: no orphans."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
# A rank that exits because another rank of its world is gone exits with this code, so
# that its launcher names the rank that failed first, not the ones that followed it.
PEER_LOST_EXIT_CODE = 3
# Set once a deferred stop signal arrived (``defer_stop_signals``).
_stop_requested = threading.Event()
_on_stop_signal: list[Callable[[int], None]] = []


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits, so a rank never
    outlives a launcher (or torchrun agent) that was killed. No-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except OSError as e:
        logger.warning("cannot set the parent-death signal: %s", e)


def stop_requested() -> bool:
    """True once this process got SIGTERM or SIGINT under ``defer_stop_signals``."""
    return _stop_requested.is_set()


def on_stop_signal(callback: Callable[[int], None]) -> None:
    """Also call ``callback(signum)`` on every deferred stop signal (torchrun rank 0:
    forward it to its frontend)."""
    _on_stop_signal.append(callback)


def defer_stop_signals(grace_s: float, name: str) -> None:
    """For a scheduler rank of a server: SIGTERM / SIGINT do not stop it at once, since the
    frontend is draining its requests and still needs it. The frontend's launcher (or, under
    torchrun, the exit of rank 0) ends the rank afterwards; the first signal also arms a
    fallback exit (code 0) after ``grace_s`` seconds in case nothing does."""

    def fallback() -> None:
        time.sleep(grace_s)
        logger.warning("%s: still running %.0f s after a stop signal; exiting", name, grace_s)
        os._exit(0)

    def handler(signum, frame) -> None:
        if not _stop_requested.is_set():
            _stop_requested.set()
            logger.info("%s: got %s; serving on while the frontend drains", name,
                        signal.Signals(signum).name)
            threading.Thread(target=fallback, daemon=True, name="stop-fallback").start()
        for callback in _on_stop_signal:
            callback(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def lowest_cpu_priority() -> str:
    """Put the calling thread (Linux applies both per thread; a new process's first thread
    is the process) where it runs only on otherwise idle cores: SCHED_IDLE, else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        except (AttributeError, OSError):
            return "unchanged"
        return "nice 19"


def freeze_startup_heap() -> float:
    """Collect once, then move every object alive now (modules, the model's Python objects,
    the tokenizer: ~500k in a scheduler rank) out of the collector's reach: a full
    collection then scans only what serving allocated. Unfrozen, a full collection took
    ~40-200 ms in the frontend and a rank (a pause of every stream). What vLLM and SGLang do
    after start-up too. Returns the seconds the collection took."""
    import gc

    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start
