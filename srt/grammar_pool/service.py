"""The pool service: one process per node, started by the node's first rank
(``start_pool_service``); every rank of the node (all its TP and DP ranks) connects.

It compiles each distinct grammar once for the whole node: a task asked by several ranks
(the ranks of a TP group ask within milliseconds of each other) waits on one compile, and
recent results stay in a byte-bounded cache for ranks that ask later. A compile that runs
past ``timeout_s``, or that no rank wants any more, is stopped by killing its worker
(SIGKILL: its core is free at once) and a fresh worker takes its place. Only the agreed
poll budget (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS) decides for the ranks; a timeout here is
one more failure every waiting rank receives alike."""
from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

import zmq

from srt.grammar_pool.messages import (RESULT_CODEC, TASK_CODEC, CompileRelease, CompileResult,
                                       CompileTask, WorkerReady)
from srt.grammar_pool.private_dir import pool_dir_problem
from srt.grammar_pool.worker import build_backend, lowest_cpu_priority, run_worker
from srt.transport.wire import WireError

logger = logging.getLogger(__name__)
Key = tuple[str, str]
TIMEOUT_MESSAGE = ("Grammar compile timed out: the {kind} grammar did not compile within {t:g} s "
                   "(GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT); its compile was stopped.")
# How the service is told to stop (by its rank, or the kernel when the rank dies): SIGTERM
# and SIGINT are ignored, since they reach the whole process group during a drain.
STOP_SIGNAL = signal.SIGUSR1
MAX_FAILED_STARTS = 3
# A compile nobody waits for any more is killed once it has run this long: most compiles
# end sooner, and a fresh worker costs seconds of CPU to start.
RELEASE_GRACE_S = 1.0
CRASH_MESSAGE = ("Failed to compile {kind} grammar: the compiler process died while compiling it "
                 "(exit code {code}).")


@dataclass(frozen=True)
class PoolConfig:
    """Everything the service and its workers need (sent once, over the service's stdin)."""

    server_args: object  # ServerArgs
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    node_rank: int
    directory: str  # private (mkdtemp, 0700) directory holding the IPC socket; checked at bind
    address: str
    num_workers: int
    timeout_s: float
    cache_bytes: int = 512 * 1024 * 1024


class Worker:
    """A forked child of the service: it starts in milliseconds with the service's backend
    already built (copy-on-write), so killing a compile costs nothing to replace."""

    def __init__(self, ctx, config: PoolConfig, index: int, backend) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_worker, args=(child, config, index, backend),
                                name=f"grammar_compile_{index}", daemon=True)
        self.proc.start()
        child.close()
        self.index, self.ready = index, False
        self.task: Optional[Key] = None
        self.started = 0.0
        self.abandoned = False  # no rank wants its task any more

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(1.0)
        self.conn.close()


class PoolService:
    def __init__(self, config: PoolConfig, backend) -> None:
        """PermissionError (naming the path) unless ``config.directory`` is private to us:
        never bind in, or adopt, a directory another user made or can enter."""
        problem = pool_dir_problem(config.directory)
        if problem is not None:
            raise PermissionError(problem)
        self.config, self.backend = config, backend
        # fork: workers inherit the built backend. The service's only other threads are
        # ZMQ's, which a worker never touches (it exits with os._exit, multiprocessing's way).
        self.ctx = mp.get_context("fork")
        self.zmq = zmq.Context()
        self.sock = self.zmq.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # results are few; never drop one
        self.sock.bind(config.address)
        self.started_workers = itertools.count()  # numbers process titles
        self.workers = [self._new_worker() for _ in range(config.num_workers)]
        self.failed_starts = 0  # workers that died before they were ready, in a row
        self.waiting: dict[Key, set[bytes]] = {}  # key -> ranks (ZMQ identities) that want it
        self.queue: deque[Key] = deque()
        self.results: OrderedDict[Key, tuple[bytes, bytes]] = OrderedDict()
        self.result_bytes = 0

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        while True:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            by_fd = {w.conn.fileno(): w for w in self.workers}
            for fd in by_fd:
                poller.register(fd, zmq.POLLIN)
            events = dict(poller.poll(100))
            if self.sock in events:
                self._read_ranks()
            for fd, worker in by_fd.items():
                if fd in events and worker in self.workers:  # not replaced meanwhile
                    self._read_worker(worker)
            self._stop_overdue()
            self._dispatch()

    def _read_ranks(self) -> None:
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:  # not two frames: not one of our ranks
                continue
            try:
                msg = TASK_CODEC.decode(frame)
            except WireError as e:
                logger.warning("dropped a malformed message: %s", e)
                continue
            key = (msg.kind, msg.spec)
            if isinstance(msg, CompileTask):
                self._want(ident, key)
            elif isinstance(msg, CompileRelease):
                self._release(ident, key)

    def _want(self, ident: bytes, key: Key) -> None:
        done = self.results.get(key)
        if done is not None:
            self.results.move_to_end(key)
            self.sock.send_multipart([ident, *done], copy=False)
            return
        if key not in self.waiting:
            self.waiting[key] = set()
            running = next((w for w in self.workers if w.task == key), None)
            if running is not None:  # abandoned a moment ago: wanted again
                running.abandoned = False
            else:
                self.queue.append(key)
        self.waiting[key].add(ident)

    def _release(self, ident: bytes, key: Key) -> None:
        wanted = self.waiting.get(key)
        if wanted is None:
            return
        wanted.discard(ident)
        if wanted:
            return
        del self.waiting[key]
        if key in self.queue:
            self.queue.remove(key)
            return
        for worker in self.workers:
            if worker.task == key:  # stopped by _stop_overdue unless it ends first
                worker.abandoned = True

    def _read_worker(self, worker: Worker) -> None:
        try:
            header = worker.conn.recv_bytes()
            msg = RESULT_CODEC.decode(header)
            if isinstance(msg, WorkerReady):
                worker.ready, self.failed_starts = True, 0
                return
            data = worker.conn.recv_bytes()
        except (EOFError, OSError, WireError):
            self._worker_died(worker)
            return
        key, worker.task = worker.task, None
        if key is not None and key == (msg.kind, msg.spec):
            self._finish(key, header, data)

    def _worker_died(self, worker: Worker) -> None:
        i = self.workers.index(worker)
        worker.proc.join(1.0)
        if not worker.ready:
            self.failed_starts += 1
            if self.failed_starts >= MAX_FAILED_STARTS:  # its log says why; the rank reports it
                logger.error("%d compile workers in a row failed to start; stopping the pool",
                             self.failed_starts)
                sys.exit(1)
        key = worker.task
        logger.error("compile worker %d exited (code %s)%s", worker.index, worker.proc.exitcode,
                     f" while compiling a {key[0]} grammar" if key else "")
        if key is not None:
            self._fail(key, CRASH_MESSAGE.format(kind=key[0], code=worker.proc.exitcode),
                       time.monotonic() - worker.started)
        worker.task = None
        self._replace(i)

    def _stop_overdue(self) -> None:
        now = time.monotonic()
        for i, worker in reversed(list(enumerate(self.workers))):
            if worker.task is not None and worker.abandoned and now - worker.started > RELEASE_GRACE_S:
                logger.info("stopped a %s compile no request waits for (%.1f s in)",
                            worker.task[0], now - worker.started)
                worker.task = None
                self._replace(i)
            elif worker.task is not None and now - worker.started > self.config.timeout_s:
                key = worker.task
                logger.warning("a %s compile ran past %g s (GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT): "
                               "killed its worker", key[0], self.config.timeout_s)
                worker.task = None
                self._replace(i)
                self._fail(key, TIMEOUT_MESSAGE.format(kind=key[0], t=self.config.timeout_s),
                           now - worker.started)

    def _dispatch(self) -> None:
        for worker in self.workers:
            if not self.queue:
                return
            if worker.ready and worker.task is None:
                key = self.queue.popleft()
                worker.task, worker.started, worker.abandoned = key, time.monotonic(), False
                worker.conn.send_bytes(TASK_CODEC.encode(CompileTask(*key)))

    # ---- results ------------------------------------------------------------------------
    def _fail(self, key: Key, message: str, seconds: float) -> None:
        header = RESULT_CODEC.encode(CompileResult(key[0], key[1], "invalid", seconds, 0.0, "pool"))
        self._finish(key, header, message.encode())

    def _finish(self, key: Key, header: bytes, data: bytes) -> None:
        for ident in self.waiting.pop(key, ()):
            self.sock.send_multipart([ident, header, data], copy=False)
        size = len(header) + len(data) + len(key[1])
        if size <= self.config.cache_bytes:
            self.results[key] = (header, data)
            self.result_bytes += size
            while self.result_bytes > self.config.cache_bytes:
                old_key, (h, d) = self.results.popitem(last=False)
                self.result_bytes -= len(h) + len(d) + len(old_key[1])

    def _replace(self, i: int) -> None:
        """Kill worker ``i``; a fresh one takes its place."""
        self.workers[i].kill()
        self.workers[i] = self._new_worker()

    def _new_worker(self) -> Worker:
        # A killed worker at idle priority may take longer than kill()'s join to exit under
        # full load: reap any such zombie now.
        mp.active_children()
        return Worker(self.ctx, self.config, next(self.started_workers), self.backend)


def start_pool_service(config: PoolConfig) -> subprocess.Popen:
    """Start the node's service as a child of this rank (a daemonic multiprocessing process
    may not have children, hence a plain subprocess). Its config goes over its stdin: a
    pipe to our own child, so pickle is safe here (nothing from a network is unpickled)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "srt.grammar_pool.service"],
                            stdin=subprocess.PIPE, env=env, cwd=root)
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()
    return proc


def main() -> None:
    import setproctitle

    from srt.process_utils import die_with_parent

    config: PoolConfig = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=getattr(logging, config.server_args.log_level.upper()),
                        format=f"%(asctime)s [grammar_pool node{config.node_rank}] "
                               "%(levelname)s %(name)s: %(message)s")
    # Checked before the stop handler exists: a directory that is not ours is never removed.
    problem = pool_dir_problem(config.directory)
    if problem is not None:
        logger.error("refusing to start the grammar compile pool: %s", problem)
        sys.exit(1)

    def stop(signum, frame) -> None:  # the rank is gone or closed us: leave no socket file
        shutil.rmtree(config.directory, ignore_errors=True)
        os._exit(0)  # the workers follow (their parent-death signal)

    signal.signal(STOP_SIGNAL, stop)
    die_with_parent(STOP_SIGNAL)  # never outlive the rank that started it
    # A stop signal to the rank's process group (Ctrl-C, a drain) is for the rank: the pool
    # serves on while it drains and goes when the rank does (parent-death signal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setproctitle.setproctitle(f"gramsync::grammar_pool_node{config.node_rank}")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # its thread pool must not exist at fork
    import torch

    torch.set_num_threads(1)
    # Built once, at the lowest priority like everything here: it overlaps the model load
    # without slowing it; a compile asked before it is ready waits for it.
    priority = lowest_cpu_priority()
    backend = build_backend(config)
    logger.info("%d compile workers, timeout %g s, %s", config.num_workers, config.timeout_s, priority)
    PoolService(config, backend).run()


if __name__ == "__main__":
    main()
