"""A compile worker: one process of the node's pool, forked by the pool service.

It inherits the service's grammar backend, built like the ranks' (``create_grammar_backend``,
plugins and ``--reasoning-parser`` included), then compiles one task at a time and sends the
result back exported (``BaseGrammarObject.export``). It runs at the lowest CPU priority, so the
forward pass never waits for it; the service kills it when its compile runs past the
timeout or no rank wants the grammar any more, and starts a fresh one."""
from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection

from srt.grammar_pool.messages import RESULT_CODEC, TASK_CODEC, CompileResult, CompileTask, WorkerReady
from srt.process_utils import lowest_cpu_priority  # noqa: F401 (used here and re-exported)

logger = logging.getLogger(__name__)


def build_backend(config):
    """The rank's grammar backend, built from the pool's config (``service.PoolConfig``)."""
    from constrained.registry import create_grammar_backend
    from srt.tokenizer_utils import get_tokenizer

    args = config.server_args
    tokenizer = get_tokenizer(args.tokenizer_path or args.model_path)
    return create_grammar_backend(args, tokenizer, config.vocab_size, config.eos_token_ids)


def compile_one(backend, task: CompileTask) -> tuple[bytes, bytes]:
    """(CompileResult frame, grammar bytes) for one task; never raises."""
    key = (task.kind, task.spec)
    before = backend.metrics.snapshot().auto_fallbacks
    cpu, wall = time.process_time(), time.perf_counter()
    value = backend.init_value(key)  # a failure comes back as an InvalidGrammarObject
    try:
        fmt, data = value.export()
    except Exception as e:  # never expected from the built-in backends
        fmt, data = "invalid", f"Failed to compile {task.kind} grammar: cannot export it ({e})".encode()
    after = backend.metrics.snapshot().auto_fallbacks
    fallbacks = tuple(k for k, n in after.items() for _ in range(n - before.get(k, 0)))
    header = CompileResult(task.kind, task.spec, fmt, time.perf_counter() - wall,
                           time.process_time() - cpu, value.stats.dispatch_type, fallbacks,
                           tuple(value.stats.gaps))
    return RESULT_CODEC.encode(header), data


def run_worker(conn: Connection, config, index: int, backend) -> None:
    """Entry point of a worker process (multiprocessing, fork)."""
    import setproctitle

    from srt.process_utils import die_with_parent

    die_with_parent()  # never outlive the service
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service decides when a worker stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    title = f"gramsync::grammar_compile_node{config.node_rank}_{index}"
    setproctitle.setproctitle(title)
    priority = lowest_cpu_priority()  # inherited from the service; set again to be sure
    logger.debug("compile worker %d ready (pid %d, %s)", index, os.getpid(), priority)
    try:
        conn.send_bytes(RESULT_CODEC.encode(WorkerReady(os.getpid())))
        while True:
            task = TASK_CODEC.decode(conn.recv_bytes())
            setproctitle.setproctitle(f"{title} (compiling {task.kind})")  # for ps / top
            header, data = compile_one(backend, task)
            setproctitle.setproctitle(title)
            conn.send_bytes(header)
            conn.send_bytes(data)
    except (EOFError, OSError):
        return  # the service is gone (or replaced this worker)
