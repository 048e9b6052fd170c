"""Start this node's scheduler ranks and wait until the whole world is ready.

``python launch.py`` spawns the node's ranks itself (world rank = node_rank * ranks per
node + i); under torchrun each worker is one rank and ``srt/entrypoints/torchrun.py``
takes this role. Either way every rank reports a ``RankReady`` over ZMQ to the launcher
on node 0, which then knows each DP group's ``SchedulerInfo`` and request address.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq

from distributed.parallel_state import RankInfo, local_world_ranks
from distributed.process_groups import DistConfig
from srt import environ
from srt.transport.io_struct import READY_CODEC, PortArgs, RankReady, SchedulerInfo, free_port
from srt.scheduler.scheduler_process import RankLaunch, run_scheduler_process
from srt.transport.wire import DropCounter, recv_message
from srt.transport.zmq_transport import transport_for
from srt.model_executor.model_loader import resolve_model_path
from srt.process_utils import PEER_LOST_EXIT_CODE
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def prepare_server_args(server_args: ServerArgs) -> ServerArgs:
    """Resolve what all ranks must share: model directory (GGUF converted once), seed, name."""
    name = server_args.served_model_name
    if name is None:
        src = server_args.model_path or "SmolLM2-135M-Instruct"
        name = os.path.basename(os.path.normpath(src)).removesuffix(".gguf")
    model_dir = resolve_model_path(server_args.model_path)
    return dataclasses.replace(server_args, model_path=model_dir, served_model_name=name).resolved()


def dist_config(server_args: ServerArgs, init_method: Optional[str] = None,
                run_dir: Optional[str] = None) -> DistConfig:
    """``init_method`` given: torchrun's "env://" (its own store). Otherwise one node with a
    private ``run_dir`` keeps torch's store in a file there, so the store listens on no
    TCP port; several nodes meet at the TCPStore of --dist-init-addr."""
    if init_method is None and server_args.nnodes == 1 and run_dir is not None:
        init_method = f"file://{os.path.join(run_dir, 'dist_store')}"
    elif init_method is None:
        addr = server_args.dist_init_addr or f"127.0.0.1:{free_port()}"
        init_method = f"tcp://{addr}"
    # "auto" is resolved by each rank (torch.cuda there): the launcher does not import torch.
    backend = {"cuda": "nccl", "cpu": "gloo"}.get(server_args.device, "auto")
    return DistConfig(init_method, backend, server_args.dist_timeout,
                      environ.GRAMSYNC_CPU_SHM_COLLECTIVES.get())


def new_port_args(server_args: ServerArgs, node0_host: Optional[str]) -> PortArgs:
    """IPC on one node; TCP on node 0's cluster address when ranks live on other nodes."""
    if server_args.nnodes == 1:
        return PortArgs.new(server_args.dp_size)
    from srt.transport.cluster_address import node0_address

    return PortArgs.new(server_args.dp_size, node0_address(node0_host))


@dataclass
class SchedulerHandles:
    """The launcher's view of the ranks: its own children (possibly none) and, on node 0,
    what every DP group's entry rank reported."""

    procs: list[mp.Process]
    info: Optional[SchedulerInfo] = None
    input_addrs: tuple[str, ...] = ()
    extra_check: Optional[Callable[[], Optional[str]]] = None  # e.g. torchrun: parent rank gone
    _stopping: threading.Event = field(default_factory=threading.Event)

    def dead_rank(self) -> Optional[str]:
        """A message naming the rank that exited first, or None if all are alive. When a
        rank dies its peers follow within a poll interval, so several can be found dead
        at once: a rank killed by a signal comes first, one that only lost a peer last."""
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            p = min(dead, key=lambda p: (p.exitcode >= 0, p.exitcode == PEER_LOST_EXIT_CODE))
            return f"scheduler rank {p.name} (pid {p.pid}) exited with code {p.exitcode}"
        return self.extra_check() if self.extra_check else None

    def alive(self) -> bool:
        return self.dead_rank() is None

    def watch(self, on_death: Callable[[str], None], interval: float = 0.2) -> None:
        """Call ``on_death(message)`` from a daemon thread if any rank exits."""
        def loop():
            while not self._stopping.wait(interval):
                message = self.dead_rank()
                if message is not None:
                    on_death(message)
                    return
        threading.Thread(target=loop, daemon=True, name="scheduler-watch").start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the ranks now. SIGKILL: a server's ranks wait on SIGTERM (the frontend's
        drain comes first), and a rank holds nothing to save -- SIGTERM with its default
        action ended them just as abruptly."""
        self._stopping.set()
        for p in self.procs:
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.1))


def spawn_local_ranks(server_args: ServerArgs, port_args: Optional[PortArgs],
                      dist: DistConfig, defer_stop_signals: bool = False) -> list[mp.Process]:
    from srt.model_executor.cpu_allocator import children_preloaded

    ctx = mp.get_context("spawn")
    procs = []
    with children_preloaded():  # the ranks start with the allocator preloaded (cpu_allocator.py)
        for world_rank in local_world_ranks(server_args.tp_size, server_args.dp_size,
                                            server_args.nnodes, server_args.node_rank,
                                            server_args.pp_size):
            rank = RankInfo.for_world_rank(world_rank, server_args.tp_size, server_args.dp_size,
                                           server_args.nnodes, server_args.pp_size)
            launch = RankLaunch(server_args, rank, dist, port_args, defer_stop_signals)
            proc = ctx.Process(target=run_scheduler_process, name=rank.name, args=(launch,), daemon=True)
            proc.start()
            procs.append(proc)
    return procs


def launch_schedulers(server_args: ServerArgs, port_args: PortArgs,
                      defer_stop_signals: bool = False) -> SchedulerHandles:
    """Node 0 (with the frontend): spawn this node's ranks, wait for the whole world.
    ``defer_stop_signals``: the ranks serve on through SIGTERM (a server's drain)."""
    transport = transport_for(port_args, server_args.cluster_secret_file, "launcher")
    ready, _ = transport.bind(zmq.PULL, port_args.ready_ipc)  # checks its directory is private
    # One node: the IPC files' private (mkdtemp, 0700) directory also holds torch's store.
    run_dir = port_args.local_dir
    handles = SchedulerHandles([])
    try:
        dist = dist_config(server_args, run_dir=run_dir)
        handles.procs = spawn_local_ranks(server_args, port_args, dist, defer_stop_signals)
        wait_for_ranks(ready, server_args, handles)
    except BaseException:
        handles.shutdown()
        raise
    finally:
        transport.close()
    return handles


def wait_for_ranks(ready: zmq.Socket, server_args: ServerArgs, handles: SchedulerHandles) -> None:
    """Collect every rank's RankReady; fill ``handles.info`` / ``input_addrs``. Raises
    RuntimeError naming the rank on a start-up failure, a dead rank or the timeout."""
    world_size = server_args.world_size
    timeout = environ.GRAMSYNC_STARTUP_TIMEOUT.get()
    deadline = time.monotonic() + timeout
    reports: dict[int, RankReady] = {}
    drops = DropCounter("launcher ready socket")
    while len(reports) < world_size:
        if ready.poll(200):
            msg = recv_message(ready, READY_CODEC, drops)
            if msg is None or not 0 <= msg.world_rank < world_size:
                continue
            if msg.error is not None:
                raise RuntimeError(msg.error)
            reports[msg.world_rank] = msg
            continue
        dead = handles.dead_rank()
        if dead is not None:
            raise RuntimeError(f"{dead} before it was ready; see its log above")
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - reports.keys())
            names = [RankInfo.for_world_rank(r, server_args.tp_size, server_args.dp_size,
                                             pp_size=server_args.pp_size).name for r in missing]
            raise RuntimeError(f"scheduler rank(s) {', '.join(names)} did not become ready "
                               f"within {timeout} s (GRAMSYNC_STARTUP_TIMEOUT)")
    group = server_args.tp_size * server_args.pp_size  # entry: the last stage's TP rank 0
    entries = [reports[(d + 1) * group - server_args.tp_size] for d in range(server_args.dp_size)]
    handles.info = entries[0].info
    handles.input_addrs = tuple(e.input_addr for e in entries)
    logger.info("all %d scheduler ranks are ready", world_size)


def run_worker_node(server_args: ServerArgs) -> int:
    """Nodes 1..n-1 of a multi-node launch without torchrun: run this node's ranks until
    one exits; then stop the others and return a non-zero code. SIGTERM: the ranks serve
    on while node 0's frontend drains; the node exits 0 once a rank has exited (node 0
    stopped) or --graceful-shutdown-timeout (plus a margin) has passed. SIGINT: at once."""
    from srt.scheduler.scheduler_process import STOP_FALLBACK_MARGIN_S

    procs = spawn_local_ranks(server_args, None, dist_config(server_args), defer_stop_signals=True)
    handles = SchedulerHandles(procs)
    stopped = threading.Event()
    deadline: list[float] = []

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGINT:
            stopped.set()
        elif not deadline:
            logger.info("SIGTERM: node %d serves on while node 0 drains", server_args.node_rank)
            deadline.append(time.monotonic() + server_args.graceful_shutdown_timeout
                            + STOP_FALLBACK_MARGIN_S)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        while not stopped.wait(0.2):
            dead = handles.dead_rank()
            if deadline and (dead is not None or time.monotonic() > deadline[0]):
                return 0
            if dead is not None:
                logger.error("%s; stopping node %d", dead, server_args.node_rank)
                return 1
        return 0
    finally:
        handles.shutdown()
