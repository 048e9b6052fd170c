"""A first start's compile, built in a process of its own at nice 19.

Compiling the steps takes minutes of Python (Dynamo, Inductor's passes) and C++ builds.
In a thread of the serving process it held the GIL and both cores, and serving nearly
stopped while it ran. So where a rank's compile cache (``compile_cache.py``) has no
complete build yet, the rank starts this builder (``python -m srt.compile_builder``):
the same ``ModelRunner`` construction, on this rank's shard and KV-pool size, with every
collective local (``without_peers``), at nice 19 (it runs on the cycles serving leaves
and gets a sliver of a busy core), writing into the same keyed cache folder. When it exits the rank's own warm-up
thread compiles as before, now from the cache (Dynamo traces again; Inductor's work is
loaded). A failed builder is logged and the rank compiles in-process, as without it.
The builder dies with its rank (PR_SET_PDEATHSIG), on a clean stop too.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import fcntl
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

import torch

from distributed.parallel_state import RankInfo, TPGroup
from srt.compile_cache import allow_frozen_mkldnn_weights, cache_complete, mark_complete
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

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
        self.proc = subprocess.Popen([sys.executable, "-m", "srt.compile_builder", self._order_path],
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _build(order: BuildOrder) -> bool:
    from distributed.communication import without_peers
    from distributed.traceable_collectives import register_group
    from srt.model_config import ModelConfig
    from srt.model_runner import ModelRunner
    from srt.server_args import parse_model_overrides

    args = order.server_args
    args = dataclasses.replace(args, wait_for_torch_compile=True, enable_torch_compile=True,
                               disable_torch_compile=False, max_total_tokens=order.max_total_tokens)
    tp = TPGroup(rank=order.tp_rank, size=order.tp_size, name=order.tp_name)
    register_group(tp)
    model_config = ModelConfig.from_path(order.model_path, args.context_length,
                                         parse_model_overrides(args.json_model_override_args))
    with without_peers(tp):
        runner = ModelRunner(args, model_config, order.rank_info, tp, builder_folder=order.cache_folder)
    prefill = runner.compiled_prefill
    return bool(runner.compiled_decode and runner.compiled_decode.ready and (prefill is None or prefill.ready))


def main(order_path: str) -> int:
    from srt.process_utils import die_with_parent

    die_with_parent()
    faulthandler.register(signal.SIGTERM, chain=True)  # a stop says where the build was
    # nice 19, not SCHED_IDLE (the grammar pool's): a SCHED_IDLE builder never finished
    # beside a server kept busy (tests/test_compiled_tp.py's loop), where nice 19 still
    # gets a ~1.5% share of a busy core and every idle cycle.
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    with open(order_path, "rb") as f:
        order: BuildOrder = pickle.load(f)
    prefix = f"[compile-builder TP{order.tp_rank}]"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {prefix} %(message)s")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = order.cache_folder
    allow_frozen_mkldnn_weights()  # as the rank does (compile_cache.use_compile_cache)
    torch.set_num_threads(order.num_threads)
    logger.info("building into %s at nice 19", order.cache_folder)
    # One builder per folder: ranks of different DP groups with the same TP rank share a key.
    with open(os.path.join(order.cache_folder, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache_complete(order.cache_folder):
            logger.info("another builder completed this folder")
            return 0
        ok = _build(order)
        if ok:
            mark_complete(order.cache_folder)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
