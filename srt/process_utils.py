"""Process hygiene shared by every gramsync process: no orphans."""
from __future__ import annotations

import ctypes
import logging
import signal
import sys

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


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
