"""The compile builder's process (builder.py starts it): the rank's ``ModelRunner`` built
from a pickled ``BuildOrder`` with every collective local, writing the compiled graphs
into the rank's cache folder. Apart from builder.py so that the runner, which starts a
builder, and the builder's process, which builds a runner, do not import each other.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import fcntl
import logging
import os
import pickle
import signal
import sys

import torch

from distributed.communication import without_peers
from distributed.parallel_state import TPGroup
from distributed.traceable_collectives import register_group
from srt.model_executor.compiled.builder import BuildOrder
from srt.model_executor.compiled.cache import allow_frozen_mkldnn_weights, cache_complete, mark_complete
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import parse_model_overrides

logger = logging.getLogger(__name__)


def _build(order: BuildOrder) -> bool:
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
