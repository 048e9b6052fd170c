"""Entry point of a scheduler rank's process."""
from __future__ import annotations

import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

import setproctitle
import zmq

from distributed.parallel_state import SINGLE_RANK, RankInfo
from srt.managers.io_struct import PortArgs, SchedulerInfo
from srt.managers.request_receiver import OutputSender, RequestReceiver
from srt.managers.scheduler import Scheduler
from srt.managers.watchdog import Watchdog
from srt.model_config import ModelConfig
from srt.server_args import ServerArgs


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), force=True, stream=sys.stderr,
        format=f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s")


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, rank_info: RankInfo,
                          ready_pipe: Connection) -> None:
    setproctitle.setproctitle(rank_info.proc_title)
    configure_logging(server_args.log_level, rank_info.log_prefix)
    logger = logging.getLogger(__name__)
    try:
        import torch
        from transformers import AutoTokenizer

        # Two cores shared with the frontend: leave torch its default intra-op threads.
        torch.set_grad_enabled(False)
        model_config = ModelConfig.from_path(server_args.model_path, server_args.context_length)
        tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path)
        tp = SINGLE_RANK
        scheduler = Scheduler(server_args, rank_info, tp, model_config, tokenizer)
        ctx = zmq.Context()
        receiver = RequestReceiver(ctx, port_args.scheduler_input_ipc, rank_info, tp)
        sender = OutputSender(ctx, port_args.frontend_input_ipc, rank_info)
        runner = scheduler.runner
        ready_pipe.send(SchedulerInfo(
            max_total_num_tokens=runner.max_total_num_tokens,
            max_running_requests=runner.max_running_requests,
            context_len=runner.context_len,
            vocab_size=model_config.vocab_size,
            eos_token_ids=tuple(model_config.eos_token_ids)))
    except Exception:
        msg = traceback.format_exc()
        logger.error("scheduler failed to start:\n%s", msg)
        ready_pipe.send(f"{rank_info.log_prefix} scheduler failed to start:\n{msg}")
        sys.exit(1)
    logger.info("scheduler ready (pid %d)", os.getpid())
    watchdog = Watchdog(server_args.watchdog_timeout, rank_info.log_prefix)
    watchdog.start()
    try:
        scheduler.event_loop(receiver.recv, sender.send, watchdog.feed)
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        sys.exit(1)
