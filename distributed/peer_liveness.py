"""Every rank notices when any other rank of the world is gone, even across DP groups that
share no collective in steady state (e.g. DP groups on different nodes).

A daemon thread runs ``monitored_barrier`` on the world gloo group (used by nothing else
after start-up) every ``interval`` seconds. A dead peer closes its connections, so the
barrier fails at once; an unresponsive one fails it after ``timeout`` and gloo names the
rank. Either way ``on_lost(reason)`` is called -- the scheduler process exits non-zero,
and its launcher (or torchrun) takes the whole server down.
"""
from __future__ import annotations

import datetime
import logging
import threading
from typing import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)


def start_peer_liveness(world_group, interval: float, timeout: float,
                        on_lost: Callable[[str], None]) -> threading.Thread:
    def loop():
        stop = threading.Event()
        while not stop.wait(interval):
            try:
                dist.monitored_barrier(group=world_group, wait_all_ranks=True,
                                       timeout=datetime.timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - any failure means a peer is gone
                on_lost(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
                return

    thread = threading.Thread(target=loop, daemon=True, name="peer-liveness")
    thread.start()
    return thread
