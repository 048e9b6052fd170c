"""Wiring a rank to its node's compile pool: the node's first rank makes its private
directory and starts the service, every rank of the node checks that directory and
connects, and the rank's grammar backend compiles its misses there."""
from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import dataclass
from typing import Optional

from srt import environ
from srt.grammar_pool.private_dir import new_pool_dir, pool_dir_problem, pool_socket_address

logger = logging.getLogger(__name__)
LOCAL_FALLBACK = "this rank compiles grammars on its own threads"


@dataclass
class NodePool:
    address: str
    service: Optional[subprocess.Popen]  # only on the node's first rank
    client: object = None

    def attach(self, backend, log_prefix: str) -> bool:
        """Compile ``backend``'s misses in the pool; False (and the service stopped) when the
        backend cannot export its grammars (a plugin), or the pool's directory or socket
        is not private to us: it keeps compiling on its threads."""
        if backend is None or not backend.can_use_compile_pool():
            self.close()
            return False
        from srt.grammar_pool.client import CompilePoolClient

        try:  # refuses a directory or socket that is not ours alone
            self.client = CompilePoolClient(self.address, log_prefix)
        except PermissionError as e:
            logger.error("%s refusing the grammar compile pool: %s; %s", log_prefix, e, LOCAL_FALLBACK)
            self.close()
            return False
        backend.attach_compile_pool(self.client)
        if self.service is not None:
            threading.Thread(target=self._watch, args=(log_prefix,), daemon=True,
                             name="grammar-pool-watch").start()
        return True

    def _watch(self, log_prefix: str) -> None:
        """The service builds its backend while the model loads and is ready seconds after;
        the rank does not wait for it (a compile asked meanwhile just waits). If it dies,
        say so: grammar requests would then end at the poll budget."""
        code = self.service.wait()
        if self.client is not None and not self.client.closed:
            logger.error("%s the grammar compile pool exited with code %s; constrained requests "
                         "will time out (see its log above)", log_prefix, code)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.service is not None and self.service.poll() is None:
            from srt.grammar_pool.service import STOP_SIGNAL

            self.service.send_signal(STOP_SIGNAL)  # it removes its socket directory
            try:
                self.service.wait(5)
            except subprocess.TimeoutExpired:
                self.service.kill()


def pool_enabled(server_args) -> bool:
    """False when grammars compile on each rank's threads (GRAMSYNC_GRAMMAR_COMPILE_WORKERS=0,
    or --grammar-backend none)."""
    return environ.GRAMSYNC_GRAMMAR_COMPILE_WORKERS.get() > 0 and server_args.grammar_backend != "none"


def make_pool_dir(server_args, rank_info) -> Optional[str]:
    """On the node's first rank, a fresh private directory for the pool; None elsewhere
    (every rank then takes the first rank's path: ``distributed.node_share``)."""
    if rank_info.local_rank != 0 or not pool_enabled(server_args):
        return None
    return new_pool_dir()


def start_node_pool(server_args, rank_info, directory: Optional[str], vocab_size: int,
                    eos_token_ids: tuple[int, ...]) -> Optional[NodePool]:
    """The node's pool in ``directory`` (from ``make_pool_dir`` on the node's first rank);
    None when this rank compiles on its own threads: the pool is disabled, the first rank
    made none, or ``directory`` is not private to us (logged)."""
    if not pool_enabled(server_args):
        return None
    if directory is None:
        logger.warning("%s the node's first rank started no grammar compile pool; %s",
                       rank_info.log_prefix, LOCAL_FALLBACK)
        return None
    problem = pool_dir_problem(directory)
    if problem is not None:
        logger.error("%s refusing the grammar compile pool: %s; %s", rank_info.log_prefix,
                     problem, LOCAL_FALLBACK)
        return None
    workers = environ.GRAMSYNC_GRAMMAR_COMPILE_WORKERS.get()
    address = pool_socket_address(directory)
    service = None
    if rank_info.local_rank == 0:
        from srt.grammar_pool.service import PoolConfig, start_pool_service

        timeout = environ.GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT.get()
        service = start_pool_service(PoolConfig(
            server_args, vocab_size, tuple(eos_token_ids), rank_info.node_rank, directory, address,
            workers, timeout))
        logger.info("%s started the node's grammar compile pool in %s (%d workers, timeout %g s)",
                    rank_info.log_prefix, directory, workers, timeout)
    return NodePool(address, service)
