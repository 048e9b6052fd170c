"""A first start's compile, built in a process of its own at nice 19.

Compiling the steps takes minutes of Python (Dynamo, Inductor's passes) and C++ builds.
In a thread of the serving process it held the GIL and both cores, and serving nearly
stopped while it ran. So where a rank's compile cache (``compiled/cache.py``) has no
complete build yet, the rank starts this builder (``python -m srt.model_executor.compiled.build_process``):
the same ``ModelRunner`` construction, on this rank's shard and KV-pool size, with every
collective local (``without_peers``), at nice 19 (it runs on the cycles serving leaves
and gets a sliver of a busy core), writing into the same keyed cache folder. When it exits the rank's own warm-up
thread compiles as before, now from the cache (Dynamo traces again; Inductor's work is
loaded). A failed builder is logged and the rank compiles in-process, as without it.
The builder dies with its rank (PR_SET_PDEATHSIG), on a clean stop too.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time

from distributed.parallel_state import RankInfo
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The repository root (srt/model_executor/compiled/ is three levels down): the builder's cwd.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclasses.dataclass(frozen=True)
class BuildOrder:
    """What the builder process needs to build exactly the rank's graphs (pickled to it)."""
    server_args: ServerArgs
    model_path: str  # the resolved checkpoint folder
    rank_info: RankInfo
    tp_rank: int
    tp_size: int
    tp_name: str
    max_total_tokens: int
    cache_folder: str
    num_threads: int  # the rank's: Inductor's C++ code is generated for a thread count


class CompileBuilder:
    """The rank's handle on its builder process."""

    def __init__(self, order: BuildOrder, log_prefix: str):
        self.log_prefix = log_prefix
        fd, self._order_path = tempfile.mkstemp(prefix="gramsync-compile-order-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(order, f)
        self.started = time.monotonic()
        # Started from the rank's main thread: PR_SET_PDEATHSIG fires when the thread that
        # started a child ends, and this one lives as long as the rank.
        self.proc = subprocess.Popen([sys.executable, "-m", "srt.model_executor.compiled.build_process",
                                      self._order_path], cwd=_REPO)
        logger.info("%s compile builder started (pid %d, nice 19); serving eagerly meanwhile",
                    log_prefix, self.proc.pid)

    def wait(self) -> bool:
        """Block until the builder ends; True if it built every graph."""
        rc = self.proc.wait()
        self._cleanup()
        took = time.monotonic() - self.started
        if rc == 0:
            logger.info("%s compile builder done in %.1f s; loading its graphs", self.log_prefix, took)
            return True
        logger.warning("%s compile builder failed (exit %s after %.1f s); compiling in this process",
                       self.log_prefix, rc, took)
        return False

    def _cleanup(self) -> None:
        try:
            os.unlink(self._order_path)
        except FileNotFoundError:
            pass
