"""``torchrun ... launch.py``: every torchrun worker is one scheduler rank.

The world comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; single- or multi-node, static or rendezvous).
Global rank 0 also starts the HTTP frontend as a child process; if the frontend exits,
rank 0 exits too and torchrun stops every other worker, and if rank 0 dies the frontend
is told by the kernel (parent-death signal) and stops.

SIGTERM (torchrun sends it to every worker's process group on its own SIGTERM): every rank
serves on while the frontend drains (rank 0 forwards the signal to it); the frontend then
exits 0, rank 0 with it, and the other ranks exit 0 as they lose rank 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import threading

from distributed.parallel_state import RankInfo
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def torchrun_server_args(server_args: ServerArgs) -> tuple[ServerArgs, RankInfo]:
    """Check the flags against torchrun's world and derive the node layout from it."""
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world != server_args.world_size:
        pp = f" x --pp-size {server_args.pp_size}" if server_args.pp_size > 1 else ""
        raise ValueError(f"torchrun started {world} processes but --tp-size {server_args.tp_size}"
                         f"{pp} x --dp-size {server_args.dp_size} = "
                         f"{server_args.world_size}: they must match")
    nnodes = world // per_node
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    server_args = dataclasses.replace(server_args, nnodes=nnodes, node_rank=rank // per_node,
                                      dist_init_addr=master)
    info = RankInfo.for_world_rank(rank, server_args.tp_size, server_args.dp_size, nnodes,
                                   server_args.pp_size)
    if info.local_rank != int(os.environ["LOCAL_RANK"]):
        raise ValueError(f"torchrun gave RANK {rank} LOCAL_RANK {os.environ['LOCAL_RANK']}, "
                         "but gramsync expects consecutive ranks per node")
    return server_args, info


def torchrun_main(server_args: ServerArgs) -> None:
    from srt.entrypoints.launcher import dist_config, new_port_args, prepare_server_args
    from srt.scheduler.scheduler_process import RankLaunch, run_scheduler_process

    try:
        server_args, rank = torchrun_server_args(server_args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if server_args.nnodes > 1:  # every worker must hold it: nothing sends it over the network
        from srt.security.cluster_secret import ClusterSecretError, require_secret

        try:
            require_secret(server_args.cluster_secret_file)
        except ClusterSecretError as e:
            sys.exit(f"error: {e}")
    server_args = prepare_server_args(server_args)  # per node: GGUF conversion is locked
    port_args = None
    if rank.world_rank == 0:
        port_args = new_port_args(server_args, os.environ["MASTER_ADDR"])
        frontend = mp.get_context("spawn").Process(
            target=run_frontend, args=(server_args, port_args, os.getpid()),
            name="frontend", daemon=True)
        frontend.start()
        _exit_with(frontend)
        from srt.process_utils import on_stop_signal

        def forward(signum: int) -> None:  # a SIGTERM to rank 0 alone still drains the server
            if frontend.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frontend.pid, signum)

        on_stop_signal(forward)
    run_scheduler_process(RankLaunch(server_args, rank, dist_config(server_args, "env://"),
                                     port_args, defer_stop_signals=True))


def _exit_with(frontend: mp.Process) -> None:
    """Rank 0 leaves when its frontend does (stopped by a user, or failed)."""
    from srt.process_utils import stop_requested

    def loop():
        frontend.join()
        code = frontend.exitcode or 0
        if code == 0 and stop_requested():  # drained after a SIGTERM: a clean stop
            logging.getLogger(__name__).info("the frontend has drained and exited; stopping rank 0")
            os._exit(0)
        logging.getLogger(__name__).error("the frontend exited with code %s; stopping rank 0", code)
        os._exit(code if code > 0 else 1)
    threading.Thread(target=loop, daemon=True, name="frontend-watch").start()


def run_frontend(server_args: ServerArgs, port_args, parent_pid: int) -> None:
    """The frontend process under torchrun: wait for every rank, then serve."""
    import signal

    import zmq

    from srt.entrypoints.http_server import _init_frontend_process, prefetch_tokenizer, serve
    from srt.entrypoints.http_socket import bind_http_socket
    from srt.entrypoints.launcher import SchedulerHandles, wait_for_ranks
    from srt.transport.zmq_transport import transport_for
    from srt.process_utils import die_with_parent

    die_with_parent(signal.SIGTERM)
    _init_frontend_process(server_args)

    def parent_gone():
        if os.getppid() != parent_pid:
            return "scheduler rank DP0_TP0 (the frontend's parent, torchrun rank 0) exited"
        return None

    try:
        http_socket = bind_http_socket(server_args.host, server_args.port)  # see http_socket.py
    except RuntimeError as e:
        port_args.remove_local_dir()
        sys.exit(f"gramsync: {e}")
    tokenizer = prefetch_tokenizer(server_args)
    handles = SchedulerHandles([], extra_check=parent_gone)
    transport = transport_for(port_args, server_args.cluster_secret_file, "launcher")
    ready, _ = transport.bind(zmq.PULL, port_args.ready_ipc)
    try:
        try:
            wait_for_ranks(ready, server_args, handles)
        except RuntimeError as e:
            sys.exit(f"gramsync: {e}")
        finally:
            transport.close()
        serve(server_args, port_args, handles, tokenizer, http_socket)
    finally:
        http_socket.close()
        port_args.remove_local_dir()
