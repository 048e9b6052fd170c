"""Entry point of a scheduler rank's process (spawned by the launcher, or a torchrun worker).

Start-up order: join the world and build the TP group -> learn the endpoints and the shared
seed from world rank 0 -> load the model -> report ``RankReady`` to the launcher -> loop.
Any failure before the loop is reported to the launcher with its traceback; any failure
in the loop exits non-zero, which the launcher (or torchrun) turns into a server exit.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import setproctitle
import zmq

from distributed.parallel_state import RankInfo
from distributed.process_groups import DistConfig
from srt.transport.io_struct import READY_CODEC, PortArgs, RankReady, SchedulerInfo
from srt.server_args import ServerArgs

if TYPE_CHECKING:  # imported at run time only inside the rank process (heavy)
    from distributed.parallel_state import TPGroup
    from distributed.pipeline import PipelineGroup
    from srt.transport.request_receiver import OutputSender, RequestReceiver
    from srt.scheduler.scheduler import Scheduler
    from srt.scheduler.watchdog import Watchdog
    from srt.transport.zmq_transport import ZmqTransport

logger = logging.getLogger(__name__)

PEER_CHECK_INTERVAL_S = 2.0
# A rank told to stop (SIGTERM) exits by itself this long after --graceful-shutdown-timeout
# if neither its launcher nor the loss of rank 0 has ended it by then.
STOP_FALLBACK_MARGIN_S = 15.0


@dataclass(frozen=True)
class RankLaunch:
    """Everything a rank process needs. ``port_args`` is None on ranks that receive it
    from world rank 0 (other nodes; torchrun workers)."""

    server_args: ServerArgs
    rank_info: RankInfo
    dist: DistConfig
    port_args: Optional[PortArgs] = None
    # Part of a server (not the offline Engine): SIGTERM/SIGINT wait for the frontend's
    # drain (srt/process_utils.py defer_stop_signals).
    defer_stop_signals: bool = False


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), force=True, stream=sys.stderr,
        format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s")


def run_scheduler_process(launch: RankLaunch) -> None:
    """The rank process's whole life: set up, start (or report why not), serve."""
    _setup_process(launch)
    rank = _start_rank(launch)  # exits 1 if the rank cannot start
    from srt.model_executor.cpu_allocator import loaded_allocator

    logger.info("scheduler ready (pid %d, allocator %s)", os.getpid(), loaded_allocator() or "glibc")
    from srt.scheduler.watchdog import Watchdog

    watchdog = Watchdog(rank.server_args.watchdog_timeout, launch.rank_info.log_prefix)
    watchdog.start()
    if rank.world is not None:
        _exit_when_a_peer_is_lost(rank.world, rank.server_args)
    _serve(rank, watchdog)


@dataclass(frozen=True)
class _JoinedWorld:
    """What a rank knows once it is in the world: the values world rank 0 decided."""

    server_args: ServerArgs  # with the world's shared random_seed
    tp: TPGroup
    pipeline: Optional[PipelineGroup]  # --pp-size > 1: this rank's stage and its DP group
    world: Optional[Any]  # the gloo world group; None on a single-rank world
    port_args: PortArgs
    pool_dir: Optional[str]  # the node's compile pool directory (None: no pool)
    transport: ZmqTransport


@dataclass(frozen=True)
class _StartedRank:
    """A rank ready to serve (stays in this process)."""

    server_args: ServerArgs
    world: Optional[Any]
    scheduler: Scheduler
    receiver: RequestReceiver
    sender: OutputSender
    info: SchedulerInfo


# Imported first thing in the start-up (in this order), before the rank joins the world:
# an import error fails the rank before its process groups exist, with nothing yet to
# report it on. The helpers below import what they use again (a lookup by then).
_RANK_MODULES = (
    "torch", "distributed.broadcast", "distributed.node_share", "distributed.pipeline",
    "distributed.process_groups",
    "srt.grammar_pool.node_pool", "srt.scheduler.batch_log", "srt.transport.cluster_address",
    "srt.transport.request_receiver", "srt.transport.zmq_transport", "srt.scheduler.scheduler",
    "srt.scheduler.watchdog", "srt.model_executor.model_config",
)


def _setup_process(launch: RankLaunch) -> None:
    """Process title, logging and stop signals: set before anything can fail, so every
    failure is logged under the rank's prefix."""
    from srt.process_utils import defer_stop_signals, die_with_parent

    die_with_parent()  # never outlive the launcher (or torchrun agent)
    rank_info = launch.rank_info
    if launch.defer_stop_signals:
        defer_stop_signals(launch.server_args.graceful_shutdown_timeout + STOP_FALLBACK_MARGIN_S,
                           rank_info.name)
    setproctitle.setproctitle(rank_info.proc_title)
    configure_logging(launch.server_args.log_level, rank_info.log_prefix)


def _start_rank(launch: RankLaunch) -> _StartedRank:
    """Join the world, build the scheduler and report ``RankReady`` to the launcher; on any
    failure, report the traceback instead (once the ready socket exists) and exit 1."""
    ready_sock = None
    try:
        for name in _RANK_MODULES:
            importlib.import_module(name)
        joined = _join_world(launch)
        ready_sock = joined.transport.connect(zmq.PUSH, joined.port_args.ready_ipc)
        ready_sock.setsockopt(zmq.LINGER, 5000)  # the report must leave before close()
        rank = _build_scheduler(launch, joined)
        rank_info = launch.rank_info
        ready_sock.send(READY_CODEC.encode(RankReady(
            rank_info.world_rank, rank_info.name,
            info=rank.info if rank_info.is_entry_rank else None,
            input_addr=rank.receiver.address)))
    except Exception:
        _report_start_failure(launch.rank_info, ready_sock)
    ready_sock.close()
    return rank


def _report_start_failure(rank_info: RankInfo, ready_sock: Optional[zmq.Socket]) -> NoReturn:
    """Log the current exception, send it to the launcher if we can, and exit 1."""
    msg = traceback.format_exc()
    logger.error("scheduler failed to start:\n%s", msg)
    if ready_sock is not None:
        ready_sock.send(READY_CODEC.encode(RankReady(
            rank_info.world_rank, rank_info.name,
            error=f"scheduler {rank_info.name} failed to start:\n{msg}")))
        ready_sock.close()
    sys.exit(1)


def _configure_torch(server_args: ServerArgs, rank_info: RankInfo) -> None:
    """Inference only (no autograd); on CPU, the node's ranks split its cores."""
    import torch

    torch.set_grad_enabled(False)
    if server_args.resolved_device() == "cpu":  # ranks of a node share its cores
        per_node = rank_info.world_size // rank_info.nnodes
        share = max(1, (os.cpu_count() or 1) // per_node)
        # torch.get_num_threads() honours OMP_NUM_THREADS: a user's lower cap wins.
        torch.set_num_threads(min(share, torch.get_num_threads()))


def _join_world(launch: RankLaunch) -> _JoinedWorld:
    """Build the process groups and take the endpoints, the seed and the compile pool's
    directory from the ranks that decide them."""
    from distributed.broadcast import broadcast_pyobj
    from distributed.node_share import share_from_node_leader
    from distributed.pipeline import init_pipeline_group
    from distributed.process_groups import init_process_groups
    from srt.grammar_pool.node_pool import make_pool_dir
    from srt.transport.zmq_transport import transport_for

    rank_info, server_args = launch.rank_info, launch.server_args
    _configure_torch(server_args, rank_info)
    tp, world = init_process_groups(rank_info, launch.dist)
    pipeline = init_pipeline_group(rank_info, launch.dist.timeout_s, launch.dist.device_backend)
    port_args, seed = launch.port_args, server_args.random_seed
    if world is not None:  # world rank 0 decides; everyone must use the same values
        port_args, seed = broadcast_pyobj((port_args, seed), rank_info.world_rank == 0, 0, world)
    server_args = dataclasses.replace(server_args, random_seed=seed)
    # The node's first rank makes its compile pool's private directory; every rank of
    # the world takes part in handing out its path (one collective, whatever the flags).
    pool_dir = share_from_node_leader(rank_info, world, make_pool_dir(server_args, rank_info))
    transport = transport_for(port_args, server_args.cluster_secret_file, rank_info.name)
    return _JoinedWorld(server_args, tp, pipeline, world, port_args, pool_dir, transport)


def _build_scheduler(launch: RankLaunch, joined: _JoinedWorld) -> _StartedRank:
    """Load the model and tokenizer, build the scheduler and its request/output sockets."""
    from srt.grammar_pool.node_pool import start_node_pool
    from srt.scheduler.batch_log import BatchLog
    from srt.transport.cluster_address import this_node_address
    from srt.transport.request_receiver import OutputSender, RequestReceiver
    from srt.scheduler.scheduler import Scheduler
    from srt.model_executor.model_config import ModelConfig
    from srt.server_args import parse_model_overrides
    from srt.tokenizer_utils import get_tokenizer

    rank_info, server_args, port_args = launch.rank_info, joined.server_args, joined.port_args
    model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length,
                                         parse_model_overrides(server_args.json_model_override_args))
    # Started before the model loads, so its workers warm up meanwhile.
    grammar_pool = start_node_pool(server_args, rank_info, joined.pool_dir,
                                   model_config.vocab_size, tuple(model_config.eos_token_ids))
    tokenizer = get_tokenizer(server_args.tokenizer_path or server_args.model_path)
    batch_log = BatchLog.from_env(rank_info)
    scheduler = Scheduler(server_args, rank_info, joined.tp, model_config, tokenizer, batch_log,
                          joined.pipeline)
    server_args = scheduler.server_args  # as served (a hybrid model switches some features off)
    if grammar_pool is not None:
        grammar_pool.attach(scheduler.grammar_manager.backend, rank_info.log_prefix)
    node_address = this_node_address(launch.dist.init_method) if port_args.is_tcp else None
    receiver = RequestReceiver(joined.transport, port_args.scheduler_input_ipcs[rank_info.dp_rank],
                               rank_info, scheduler.ctrl, node_address, model_config.vocab_size)
    sender = OutputSender(joined.transport, port_args.frontend_input_ipc, rank_info)
    runner = scheduler.runner
    info = SchedulerInfo(
        max_total_num_tokens=runner.max_total_num_tokens,
        max_running_requests=runner.max_running_requests,
        context_len=runner.context_len,
        vocab_size=model_config.vocab_size,
        eos_token_ids=tuple(model_config.eos_token_ids),
        prompt_logprob_cache_bytes_per_token=runner.logprob_bytes_per_token(),
        linear_state_slots=runner.state_pool.num_slots if runner.state_pool is not None else 0,
        linear_state_bytes_per_slot=runner.state_bytes_per_slot,
        model_limits=scheduler.model_limits)
    return _StartedRank(server_args, joined.world, scheduler, receiver, sender, info)


def _exit_when_a_peer_is_lost(world: Any, server_args: ServerArgs) -> None:
    """A world cannot go on without any of its ranks: exit once one stops answering
    (cleanly when the server is stopping anyway)."""
    from distributed.peer_liveness import start_peer_liveness
    from srt.process_utils import PEER_LOST_EXIT_CODE, stop_requested

    def lost(reason: str) -> None:
        if stop_requested():  # the server is stopping: rank 0 is done draining
            logger.info("another rank of the world has stopped; exiting")
            os._exit(0)
        logger.error("lost contact with another rank of the world (%s); exiting", reason)
        os._exit(PEER_LOST_EXIT_CODE)

    liveness_timeout = server_args.watchdog_timeout or server_args.dist_timeout
    start_peer_liveness(world, PEER_CHECK_INTERVAL_S, liveness_timeout, lost)


def _serve(rank: _StartedRank, watchdog: Watchdog) -> None:
    """Run the event loop; any error in it exits the process (0 if the server is stopping)."""
    from srt.process_utils import freeze_startup_heap, stop_requested

    logger.debug("%s start-up heap frozen (%.2f s)", rank.scheduler.rank_info.log_prefix, freeze_startup_heap())
    try:
        rank.scheduler.event_loop(rank.receiver.recv, rank.sender.send, watchdog.feed)
    except Exception:
        if stop_requested():  # told to stop, and a peer (rank 0, after the drain) is gone
            logger.info("another rank of the world has stopped (%s); exiting",
                        traceback.format_exc().strip().splitlines()[-1][:200])
            sys.exit(0)
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        sys.exit(1)
