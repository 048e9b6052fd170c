"""Start the scheduler rank processes and wait until they are ready (TP=1/DP=1 here)."""
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

from distributed.parallel_state import RankInfo
from srt import environ
from srt.managers.io_struct import PortArgs, SchedulerInfo
from srt.managers.scheduler_process import run_scheduler_process
from srt.model_loader import resolve_model_path
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


@dataclass
class SchedulerHandles:
    procs: list[mp.Process]
    info: SchedulerInfo
    _stopping: threading.Event = field(default_factory=threading.Event)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def watch(self, on_death: Callable[[str], None], interval: float = 0.5) -> None:
        """Call ``on_death(message)`` from a daemon thread if any rank exits unexpectedly."""
        def loop():
            while not self._stopping.wait(interval):
                for p in self.procs:
                    if not p.is_alive():
                        on_death(f"scheduler process {p.name} exited with code {p.exitcode}")
                        return
        threading.Thread(target=loop, daemon=True, name="scheduler-watch").start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(1.0)


def launch_schedulers(server_args: ServerArgs, port_args: PortArgs) -> SchedulerHandles:
    if server_args.tp_size * server_args.dp_size * server_args.nnodes != 1:
        raise NotImplementedError("--tp-size/--dp-size/--nnodes > 1 arrive with the multi-rank issue")
    ctx = mp.get_context("spawn")
    rank = RankInfo()
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler_process, name=rank.proc_title,
                       args=(server_args, port_args, rank, writer), daemon=True)
    proc.start()
    writer.close()
    handles = SchedulerHandles([proc], info=None)  # type: ignore[arg-type]
    info = _wait_ready(reader, proc, environ.GRAMSYNC_STARTUP_TIMEOUT.get())
    if not isinstance(info, SchedulerInfo):
        handles.shutdown()
        raise RuntimeError(info)
    handles.info = info
    return handles


def _wait_ready(reader, proc: mp.Process, timeout: float) -> SchedulerInfo | str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                return reader.recv()
            except EOFError:
                break
        if not proc.is_alive():
            break
    if proc.is_alive():
        return f"scheduler did not become ready within {timeout} s (GRAMSYNC_STARTUP_TIMEOUT)"
    return f"scheduler process exited with code {proc.exitcode} before it was ready"
