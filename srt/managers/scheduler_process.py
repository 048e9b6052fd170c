"""Entry point of a scheduler rank's process (spawned by the launcher, or a torchrun worker).

Start-up order: join the world and build the TP group -> learn the endpoints and the shared
seed from world rank 0 -> load the model -> report ``RankReady`` to the launcher -> loop.
Any failure before the loop is reported to the launcher with its traceback; any failure
in the loop exits non-zero, which the launcher (or torchrun) turns into a server exit.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Optional

import setproctitle
import zmq

from distributed.parallel_state import RankInfo
from distributed.process_groups import DistConfig
from srt.managers.io_struct import READY_CODEC, PortArgs, RankReady, SchedulerInfo
from srt.server_args import ServerArgs


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
    from srt.process_utils import defer_stop_signals, die_with_parent, stop_requested

    die_with_parent()  # never outlive the launcher (or torchrun agent)
    rank_info = launch.rank_info
    if launch.defer_stop_signals:
        defer_stop_signals(launch.server_args.graceful_shutdown_timeout + STOP_FALLBACK_MARGIN_S,
                           rank_info.name)
    setproctitle.setproctitle(rank_info.proc_title)
    configure_logging(launch.server_args.log_level, rank_info.log_prefix)
    logger = logging.getLogger(__name__)
    ready_sock = None
    try:
        import torch

        from distributed.broadcast import broadcast_pyobj
        from distributed.node_share import share_from_node_leader
        from distributed.process_groups import init_process_groups
        from srt.grammar_pool.node_pool import make_pool_dir, start_node_pool
        from srt.managers.batch_log import BatchLog
        from srt.managers.cluster_address import this_node_address
        from srt.managers.request_receiver import OutputSender, RequestReceiver
        from srt.managers.zmq_transport import transport_for
        from srt.managers.scheduler import Scheduler
        from srt.managers.watchdog import Watchdog
        from srt.model_config import ModelConfig

        torch.set_grad_enabled(False)
        server_args = launch.server_args
        if server_args.resolved_device() == "cpu":  # ranks of a node share its cores
            per_node = rank_info.world_size // rank_info.nnodes
            share = max(1, (os.cpu_count() or 1) // per_node)
            # torch.get_num_threads() honours OMP_NUM_THREADS: a user's lower cap wins.
            torch.set_num_threads(min(share, torch.get_num_threads()))
        tp, world = init_process_groups(rank_info, launch.dist)
        port_args, seed = launch.port_args, server_args.random_seed
        if world is not None:  # world rank 0 decides; everyone must use the same values
            port_args, seed = broadcast_pyobj((port_args, seed), rank_info.world_rank == 0, 0, world)
        server_args = dataclasses.replace(server_args, random_seed=seed)
        # The node's first rank makes its compile pool's private directory; every rank of
        # the world takes part in handing out its path (one collective, whatever the flags).
        pool_dir = share_from_node_leader(rank_info, world, make_pool_dir(server_args, rank_info))
        transport = transport_for(port_args, server_args.cluster_secret_file, rank_info.name)
        ready_sock = transport.connect(zmq.PUSH, port_args.ready_ipc)
        ready_sock.setsockopt(zmq.LINGER, 5000)  # the report must leave before close()
        from transformers import AutoTokenizer

        model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
        # Started before the model loads, so its workers warm up meanwhile.
        grammar_pool = start_node_pool(server_args, rank_info, pool_dir,
                                       model_config.vocab_size, tuple(model_config.eos_token_ids))
        tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path)
        batch_log = BatchLog.from_env(rank_info)
        scheduler = Scheduler(server_args, rank_info, tp, model_config, tokenizer, batch_log)
        if grammar_pool is not None:
            grammar_pool.attach(scheduler.grammar_manager.backend, rank_info.log_prefix)
        node_address = this_node_address(launch.dist.init_method) if port_args.is_tcp else None
        receiver = RequestReceiver(transport, port_args.scheduler_input_ipcs[rank_info.dp_rank],
                                   rank_info, tp, node_address, model_config.vocab_size)
        sender = OutputSender(transport, port_args.frontend_input_ipc, rank_info)
        runner = scheduler.runner
        info = SchedulerInfo(
            max_total_num_tokens=runner.max_total_num_tokens,
            max_running_requests=runner.max_running_requests,
            context_len=runner.context_len,
            vocab_size=model_config.vocab_size,
            eos_token_ids=tuple(model_config.eos_token_ids))
        ready_sock.send(READY_CODEC.encode(RankReady(
            rank_info.world_rank, rank_info.name, info=info if rank_info.is_entry_rank else None,
            input_addr=receiver.address)))
    except Exception:
        msg = traceback.format_exc()
        logger.error("scheduler failed to start:\n%s", msg)
        if ready_sock is not None:
            ready_sock.send(READY_CODEC.encode(RankReady(
                rank_info.world_rank, rank_info.name,
                error=f"scheduler {rank_info.name} failed to start:\n{msg}")))
            ready_sock.close()
        sys.exit(1)
    ready_sock.close()
    logger.info("scheduler ready (pid %d)", os.getpid())
    watchdog = Watchdog(server_args.watchdog_timeout, rank_info.log_prefix)
    watchdog.start()
    if world is not None:
        from distributed.peer_liveness import start_peer_liveness

        def lost(reason: str) -> None:
            if stop_requested():  # the server is stopping: rank 0 is done draining
                logger.info("another rank of the world has stopped; exiting")
                os._exit(0)
            logger.error("lost contact with another rank of the world (%s); exiting", reason)
            os._exit(1)

        liveness_timeout = server_args.watchdog_timeout or server_args.dist_timeout
        start_peer_liveness(world, PEER_CHECK_INTERVAL_S, liveness_timeout, lost)
    try:
        scheduler.event_loop(receiver.recv, sender.send, watchdog.feed)
    except Exception:
        if stop_requested():  # told to stop, and a peer (rank 0, after the drain) is gone
            logger.info("another rank of the world has stopped (%s); exiting",
                        traceback.format_exc().strip().splitlines()[-1][:200])
            sys.exit(0)
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        sys.exit(1)

