"""Per-rank grammar bookkeeping: constrained requests whose grammar is still compiling wait
in ``grammar_queue``; each scheduler iteration polls their futures briefly, the TP group
agrees (``distributed.grammar_agreement``), and the agreed-ready requests move on to the
waiting queue while the agreed-failed ones are aborted with the reason.

Everything that decides what runs -- cache hits, poll counts, the agreed sets -- is
identical on every rank; only local compile progress differs, and the agreement absorbs it.

``constrained`` does not import the serving runtime: the scheduler passes in how to read
the poll settings (live, so an environment change is seen) and how to abort a request.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, InvalidGrammarObject, fresh_copy
from constrained.schema_coverage import GrammarReport
from constrained.grammar_config import DISABLED_MESSAGE, FREE_GRAMMAR_KEY
from constrained.grammar_metrics import GrammarMetrics
from distributed.grammar_agreement import agree_on_grammar_status
from distributed.parallel_state import TPGroup

logger = logging.getLogger(__name__)
TIMEOUT_MESSAGE = ("Grammar preprocessing timed out: the {kind} grammar was not compiled within "
                   "{polls} scheduler polls (SGLANG_GRAMMAR_MAX_POLL_ITERATIONS).")


@dataclass(frozen=True)
class GrammarPolling:
    poll_interval: float = 0.005  # SGLANG_GRAMMAR_POLL_INTERVAL: seconds an idle poll waits
    max_poll_iterations: int = 10000  # SGLANG_GRAMMAR_MAX_POLL_ITERATIONS: then it times out


AbortRequest = Callable[[Any, str], None]  # (req, message): finish it with a 400


class GrammarManager:
    def __init__(self, backend: Optional[BaseGrammarBackend], tp: TPGroup, abort_request: AbortRequest,
                 polling: Callable[[], GrammarPolling] = GrammarPolling, log_prefix: str = "") -> None:
        self.backend = backend
        self.tp = tp
        self.abort_request = abort_request
        self.polling = polling
        self.log_prefix = log_prefix
        self.grammar_queue: list = []  # Reqs waiting for their compile, in arrival order
        self._agree_word = torch.zeros(1, dtype=torch.int64)  # the agreement's reused buffer
        # Cumulative counters (--enable-metrics): the backend's, so compiles count there too.
        self.metrics: GrammarMetrics = getattr(backend, "metrics", None) or GrammarMetrics()

    def process_req_with_grammar(self, req) -> bool:
        """Attach the grammar of a constrained request. True: a cache miss, the request now
        waits in ``grammar_queue``. False: it can be scheduled (hit) or it was finished with
        an error (``req.finished``)."""
        key = req.sampling_params.grammar_key
        req.grammar_key = key
        if self.backend is None:
            self.metrics.count("aborted")
            self.abort_request(req, DISABLED_MESSAGE.format(kind=key[0]))
            return False
        value, hit = self.backend.get_cached_or_future_value(key)
        if hit:
            self._attach(req, value)
            return False
        req.grammar_future, req.grammar_wait_ct = value, 0
        self.grammar_queue.append(req)
        return True

    def get_ready_grammar_requests(self, idle: bool = True) -> tuple[list, list]:
        """(ready, failed) requests, identical on every rank; failed ones are finished with
        an abort (400) carrying the reason. ``idle`` (nothing else to run; the same on every
        rank): wait up to SGLANG_GRAMMAR_POLL_INTERVAL for a compile; otherwise only look,
        so pending grammars never slow down the running batch."""
        if not self.grammar_queue:  # identical on every rank: no collective needed
            return [], []
        polling = self.polling()
        pending = {r.grammar_future for r in self.grammar_queue if not r.grammar_future.done()}
        if pending and idle:
            wait(pending, timeout=polling.poll_interval, return_when=FIRST_COMPLETED)
        max_polls = polling.max_poll_iterations
        ready, failed = set(), {}
        for i, req in enumerate(self.grammar_queue):
            req.grammar_wait_ct += 1  # counts agreed iterations: the same on every rank
            if req.grammar_future.done():
                value = _result(req.grammar_future, req.grammar_key[0])
                if isinstance(value, InvalidGrammarObject):
                    failed[i] = value.message
                else:
                    ready.add(i)
            elif req.grammar_wait_ct >= max_polls:
                failed[i] = TIMEOUT_MESSAGE.format(kind=req.grammar_key[0], polls=max_polls)
        start = time.perf_counter()
        ready, failed = agree_on_grammar_status(ready, failed, self.tp, queue_len=len(self.grammar_queue),
                                                word=self._agree_word)
        if not self.tp.is_single:
            self.metrics.observe_agreement(time.perf_counter() - start)
        if not ready and not failed:
            return [], []
        ready_reqs, failed_pairs, keep = [], [], []
        for i, req in enumerate(self.grammar_queue):
            if i in failed:
                failed_pairs.append((req, failed[i]))
            else:
                (ready_reqs if i in ready else keep).append(req)
        self.grammar_queue = keep
        for req in ready_reqs:
            value = req.grammar_future.result()
            self.backend.set_cache(req.grammar_key, value)
            self._attach(req, fresh_copy(value))
        for req, message in failed_pairs:
            self._fail(req, message)
        return ready_reqs, [req for req, _ in failed_pairs]

    def abort(self, req) -> bool:
        """Drop a queued request (aborted by the user or a timeout); True if it was queued."""
        if req not in self.grammar_queue:
            return False
        self.grammar_queue.remove(req)
        self.backend.release(req.grammar_key, self._is_wanted(req.grammar_key))
        return True

    # ---- helpers ------------------------------------------------------------------------
    def _attach(self, req, value: BaseGrammarObject) -> None:
        req.grammar_future = None
        if isinstance(value, InvalidGrammarObject):
            self.metrics.count("aborted")
            self.abort_request(req, value.message)
            return
        value.maybe_init_reasoning(req.require_reasoning, req.sampling_params.thinking_budget)
        req.grammar = value
        if req.grammar_key != FREE_GRAMMAR_KEY:  # a thinking_budget alone constrains no document
            req.grammar_report = GrammarReport(value.stats.dispatch_type.split(" ", 1)[0],
                                               not value.stats.gaps, value.stats.gaps)
        logger.debug("%s %s grammar ready: %s", self.log_prefix, req.rid, value.stats)

    def _fail(self, req, message: str) -> None:
        self.metrics.count("aborted")
        if message.startswith("Grammar preprocessing timed out"):
            self.metrics.count("timeouts")
            # Not cached: a later request may compile in time. Stop an unstarted compile.
            self.backend.release(req.grammar_key, self._is_wanted(req.grammar_key))
        else:  # the agreed message, so the negative cache is identical on every rank
            self.backend.set_cache(req.grammar_key, InvalidGrammarObject(message))
        req.grammar_future = None
        self.abort_request(req, message)
        logger.info("%s %s grammar failed: %s", self.log_prefix, req.rid, message)

    def _is_wanted(self, key) -> bool:
        return any(r.grammar_key == key for r in self.grammar_queue)


def _result(future: Future, kind: str) -> BaseGrammarObject:
    try:
        return future.result()
    except BaseException as e:  # cancelled, or a backend that raised past init_value
        return InvalidGrammarObject(f"Failed to compile {kind} grammar: {type(e).__name__}: {e}")
