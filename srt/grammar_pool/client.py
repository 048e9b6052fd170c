"""A rank's end of the node's compile pool.

``submit(key, backend)`` returns a Future the grammar manager polls as before; ``release``
tells the service no request of this rank waits for the key. One I/O thread owns the
DEALER socket; a second thread rebuilds each result into a grammar object
(``backend.load_exported``) at the lowest CPU priority: loading a large xgrammar grammar
takes seconds of CPU, which must not come from the forward pass. A grammar too large to
ship ("rebuild") is compiled again on two more threads at that priority."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import zmq

from constrained.base_grammar_backend import InvalidGrammarObject
from srt.grammar_pool.messages import RESULT_CODEC, TASK_CODEC, CompileRelease, CompileTask
from srt.grammar_pool.private_dir import pool_endpoint_problem
from srt.grammar_pool.worker import lowest_cpu_priority
from srt.transport.wire import WireError

logger = logging.getLogger(__name__)
_ids = itertools.count()


class CompilePoolClient:
    def __init__(self, address: str, log_prefix: str = "") -> None:
        """PermissionError (naming the path) unless ``address`` is a socket in a directory
        private to us: whoever binds it answers with grammars this rank trusts."""
        problem = pool_endpoint_problem(address)
        if problem is not None:
            raise PermissionError(problem)
        self.log_prefix = log_prefix
        self._zmq = zmq.Context()
        self._sock = self._zmq.socket(zmq.DEALER)  # used by the I/O thread only
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)  # retried by ZMQ until the service has bound it
        wake = f"inproc://grammar-pool-wake-{next(_ids)}"
        self._wake_in = self._zmq.socket(zmq.PULL)
        self._wake_in.bind(wake)
        self._wake_out = self._zmq.socket(zmq.PUSH)  # used by the scheduler thread only
        self._wake_out.connect(wake)
        for sock in (self._wake_in, self._wake_out):
            sock.setsockopt(zmq.LINGER, 0)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._futures: dict[tuple[str, str], tuple[Future, object]] = {}
        self._closed = threading.Event()
        # Grammars too large to ship are compiled again here (known to finish: the pool did).
        self._rebuilder = ThreadPoolExecutor(2, thread_name_prefix="grammar-rebuild",
                                             initializer=lowest_cpu_priority)
        self.load_cpu_seconds = 0.0  # CPU this rank spent loading pooled results (benchmarks)
        self._io = threading.Thread(target=self._io_loop, daemon=True, name="grammar-pool-io")
        self._io.start()
        threading.Thread(target=self._load_loop, daemon=True, name="grammar-pool-load").start()

    # ---- the scheduler thread -------------------------------------------------------------
    def submit(self, key: tuple[str, str], backend) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()  # only a result ends it; release() drops it
        if self._closed.is_set():  # never a future nobody will resolve
            future.set_result(InvalidGrammarObject(f"Failed to compile {key[0]} grammar: the "
                                                   "grammar compile pool client is closed"))
            return future
        with self._lock:
            self._futures[key] = (future, backend)
        self._send(TASK_CODEC.encode(CompileTask(*key)))
        return future

    def release(self, key: tuple[str, str]) -> None:
        with self._lock:
            if self._futures.pop(key, None) is None:
                return
        self._send(TASK_CODEC.encode(CompileRelease(*key)))

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Stop both threads and close every socket and the context, here and now. Never
        left to the garbage collector: a context collected in a reference cycle with its
        sockets still open (a failed test's traceback holds one) blocks forever in term()."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._results.put(None)
        self._rebuilder.shutdown(wait=False, cancel_futures=True)
        self._io.join(5.0)  # it closes the sockets it owns as it leaves (<= one 200 ms poll)
        self._wake_out.close(linger=0)
        if not self._io.is_alive():
            self._zmq.term()

    def _send(self, frame: bytes) -> None:
        if self._closed.is_set():  # shutting down: the service forgets this rank's tasks
            return
        self._outbox.put(frame)
        self._wake_out.send(b"")

    # ---- background threads -----------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._closed.is_set():
            events = dict(poller.poll(200))
            if self._wake_in in events:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                while not self._outbox.empty():
                    self._sock.send(self._outbox.get())
            if self._sock in events:
                while self._sock.poll(0):
                    frames = self._sock.recv_multipart()
                    if len(frames) == 2:
                        self._results.put(frames)
        self._sock.close(linger=0)
        self._wake_in.close(linger=0)

    def _load_loop(self) -> None:
        lowest_cpu_priority()  # this thread only
        while True:
            frames = self._results.get()
            if frames is None:
                return
            try:
                header = RESULT_CODEC.decode(frames[0])
            except WireError as e:
                logger.warning("%s dropped a malformed compile result: %s", self.log_prefix, e)
                continue
            key = (getattr(header, "kind", None), getattr(header, "spec", None))
            with self._lock:
                entry = self._futures.get(key)
            if entry is None:  # released meanwhile, or a duplicate
                continue
            if header.fmt == "rebuild":  # too large to ship: compile it here, off this thread
                self._rebuilder.submit(self._finish, key, entry, header, None)
            else:
                self._finish(key, entry, header, frames[1])

    def _finish(self, key, entry, header, data: Optional[bytes]) -> None:
        future, backend = entry
        start = time.thread_time()
        value = self._load(backend, header, data)
        self.load_cpu_seconds += time.thread_time() - start
        with self._lock:
            if self._futures.get(key) is entry:
                del self._futures[key]
                future.set_result(value)

    def _load(self, backend, header, data: Optional[bytes]):
        try:
            if data is None:  # the pool compiled it in time; it was too large to ship
                value = backend.dispatch((header.kind, header.spec))
            else:
                value = backend.load_exported(header.fmt, data)
        except Exception as e:  # a library that cannot read its own export: say so
            value = InvalidGrammarObject(f"Failed to compile {header.kind} grammar: the compiled "
                                         f"grammar could not be loaded ({type(e).__name__}: {e})")
        value.stats.compile_time = header.compile_time
        value.stats.dispatch_type = header.dispatch_type
        value.stats.gaps = header.gaps
        metrics = backend.metrics
        metrics.observe_compile(header.dispatch_type, header.kind, header.compile_time,
                                isinstance(value, InvalidGrammarObject))
        for reason, outcome in header.fallbacks if data is not None else ():  # dispatch counted its own
            metrics.count_fallback(reason, outcome)
        return value

