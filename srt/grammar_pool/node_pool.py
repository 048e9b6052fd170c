"""Wiring a rank to its node's compile pool: the node's first rank starts the service,
every rank of the node connects, and the rank's grammar backend compiles its misses there."""
from __future__ import annotations

import logging
import subprocess
import threading
from dataclasses import dataclass
from typing import Optional

from srt import environ
from srt.grammar_pool.messages import pool_address

logger = logging.getLogger(__name__)


@dataclass
class NodePool:
    address: str
    service: Optional[subprocess.Popen]  # only on the node's first rank
    client: object = None

    def attach(self, backend, log_prefix: str) -> bool:
        """Compile ``backend``'s misses in the pool; False (and the service stopped) when the
        backend cannot export its grammars (a plugin): it keeps compiling on its threads."""
        if backend is None or not backend.can_use_compile_pool():
            self.close()
            return False
        from srt.grammar_pool.client import CompilePoolClient

        self.client = CompilePoolClient(self.address, log_prefix)
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


def start_node_pool(server_args, rank_info, shared_token: str, vocab_size: int,
                    eos_token_ids: tuple[int, ...]) -> Optional[NodePool]:
    """None when grammars compile on each rank's threads (GRAMSYNC_GRAMMAR_COMPILE_WORKERS=0,
    or --grammar-backend none)."""
    workers = environ.GRAMSYNC_GRAMMAR_COMPILE_WORKERS.get()
    if workers <= 0 or server_args.grammar_backend == "none":
        return None
    directory, address = pool_address(shared_token, rank_info.node_rank)
    service = None
    if rank_info.local_rank == 0:
        from srt.grammar_pool.service import PoolConfig, start_pool_service

        timeout = environ.GRAMSYNC_GRAMMAR_COMPILE_TIMEOUT.get()
        service = start_pool_service(PoolConfig(
            server_args, vocab_size, tuple(eos_token_ids), rank_info.node_rank, directory, address,
            workers, timeout))
        logger.info("%s started the node's grammar compile pool (%d workers, timeout %g s)",
                    rank_info.log_prefix, workers, timeout)
    return NodePool(address, service)
