"""The scheduler every rank runs: the same loop, in the same order, on identical inputs.

Per iteration: receive (entry rank) and broadcast new requests and aborts -> poll grammar
compiles and agree on them (GrammarManager) -> until it is decided, agree on switching to
the compiled steps (CompiledSwitch) -> pick a prefill or decode batch under the token and KV
budgets -> run it (batch_step.py: forward -> sample -> append tokens, check stop conditions,
free finished requests) -> the entry rank sends outputs to the frontend.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import Callable, Optional, Union

import torch

from constrained.grammar_manager import GrammarManager, GrammarPolling
from constrained.registry import create_grammar_backend
from distributed.parallel_state import RankInfo, TPGroup
from distributed.pipeline import PipelineGroup
from sampling.sampling_batch_info import SamplingBatchInfo
from srt import environ
from srt.model_executor.forward_batch import ForwardMode
from srt.layers.moe.routing_digest import attach_routing_digest
from srt.scheduler.batch_log import BatchLog
from srt.scheduler.batch_step import BatchStepMixin
from srt.scheduler.logprob_tracker import take_logprob_deltas
from srt.scheduler.mask_overlap import mask_fill_executor
from srt.transport.io_struct import (AbortReq, BatchTokenOut, FinishReason, FlushCacheOut, FlushCacheReq,
                                   TokenizedGenerateReq)
from srt.scheduler.req import Req
from srt.scheduler.kv_cache_manager import KVCacheManager
from srt.scheduler.schedule_policy import PrefillAdder
from srt.scheduler.step_stats import StepStats
from srt.mem_cache.radix_cache import RadixCache
from srt.metrics.scheduler_reporter import SchedulerMetricsReporter
from srt.model_executor.model_config import ModelConfig
from srt.mem_cache.state_checkpoints import StateCheckpoints
from srt.model_executor.hybrid_limits import hybrid_serving_args
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from srt.speculative.spec_state import auto_off_reason, spec_config_from_args
from srt.speculative.step_cost import StepCostTable

logger = logging.getLogger(__name__)
Message = Union[TokenizedGenerateReq, AbortReq, FlushCacheReq]


class Scheduler(BatchStepMixin):
    def __init__(self, server_args: ServerArgs, rank_info: RankInfo, tp: TPGroup,
                 model_config: ModelConfig, tokenizer=None, batch_log: Optional[BatchLog] = None,
                 pipeline: Optional[PipelineGroup] = None):
        # Hybrid GDN models: what is refused or switched off for them (model_executor/hybrid_limits.py).
        server_args, self.model_limits = hybrid_serving_args(server_args, model_config, rank_info.log_prefix)
        self.server_args = server_args
        self.rank_info = rank_info
        self.tp = tp  # this stage's TP group: the layers' collectives, token agreement
        # --pp-size > 1: the last stage samples; agreements span the DP group (ctrl).
        self.pipeline = pipeline
        self.ctrl = pipeline.ctrl if pipeline is not None else tp
        self.batch_log = batch_log or BatchLog(None)
        self.model_config = model_config
        self.tokenizer = tokenizer  # only for stop strings
        self.runner = ModelRunner(server_args, model_config, rank_info, tp, pipeline=pipeline)
        r = self.runner
        # Hybrid models: the state pool's slots past the running requests' are the tree's checkpoints.
        checkpoints = (StateCheckpoints(r.state_pool, r.max_running_requests)
                       if r.state_pool is not None and not server_args.disable_radix_cache else None)
        tree = None if server_args.disable_radix_cache else RadixCache(
            r.token_to_kv_pool_allocator.free, r.device, checkpoints.free if checkpoints else None)
        self.kv = KVCacheManager(r.req_to_token_pool, r.token_to_kv_pool_allocator,
                                 r.token_to_kv_pool, r.device, tree, r.prompt_logprob_pool, r.state_pool,
                                 checkpoints)
        self.eos_ids = frozenset(model_config.eos_token_ids)
        self.vocab_size = model_config.vocab_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Sampling state of `running`, row for row; filtered and merged, never rebuilt.
        self.running_info: Optional[SamplingBatchInfo] = None
        self.reqs: dict[str, Req] = {}
        self.pending_outputs: list[Req] = []  # finished outside a batch (rejected, aborted)
        self.control_outputs: list[FlushCacheOut] = []  # replies to control messages
        # Unseeded sampling draws from this; same seed and call order on every rank.
        self.generator = torch.Generator(device=r.device)
        self.generator.manual_seed(server_args.random_seed or 0)
        self.clip_new_tokens = environ.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.get()
        self.num_retractions = 0
        self.chunk_size = resolve_chunk_size(server_args.chunked_prefill_size, r.device)
        self._decode_next = False  # after a prefill chunk, running requests decode first
        # --enable-mixed-chunk: a prefill batch carries the running requests' decode rows.
        self.mixed_chunk = server_args.enable_mixed_chunk
        backend = create_grammar_backend(server_args, tokenizer, self.vocab_size,
                                         tuple(model_config.eos_token_ids))
        self.grammar_manager = GrammarManager(backend, self.ctrl, **self.grammar_manager_kwargs())
        # Decode steps fill their grammar bitmask on this thread while the forward runs
        # (None: in line, where the forward's threads take every core; mask_overlap.py).
        self.mask_executor = mask_fill_executor(r.device)
        # Grammar fast-forward: forced tokens are appended without a decode step each and
        # ride along as extra rows of the next decode step, up to this many rows in all
        # (the compiled step's / CUDA graphs' largest batch: more would run it eagerly).
        self.fast_forward = not server_args.disable_grammar_fast_forward
        graph = r.compiled_decode or r.cuda_graph_runner
        self.decode_row_limit = graph.max_bs if graph is not None else server_args.torch_compile_max_bs
        # --speculative-algorithm (NGRAM; auto, the default, where exact): requests draft
        # tokens the next decode step verifies.
        self.spec_config = spec_config_from_args(server_args, r.device, r.gguf_int4, r.dtype)
        if server_args.speculative_algorithm == "auto" and rank_info.is_entry_rank:
            why = auto_off_reason(server_args, r.device, r.gguf_int4, r.dtype)
            logger.info("%s speculative decoding (auto): %s", rank_info.log_prefix,
                        f"off, {why}; --speculative-algorithm NGRAM forces it" if why else "NGRAM")
        # What its decode steps cost per row count: measured where this rank is alone.
        self.step_cost = (StepCostTable(self.spec_config.row_cost, measure=self.ctrl.is_single)
                          if self.spec_config is not None else None)
        self.step_cost_compiled = False  # the table's steps ran the compiled graphs
        self.step_stats = StepStats()  # per-phase seconds and counters, for benchmarks and logs
        # --enable-metrics, entry rank only: throttled SchedulerMetrics to the frontend.
        self.metrics_reporter = SchedulerMetricsReporter.create(server_args, rank_info)
        # Mixture of experts: every step's expert choices in the batch log (ranks must agree).
        self.routing_digest = attach_routing_digest(r.model) if self.batch_log.enabled else None

    def grammar_manager_kwargs(self) -> dict:
        """What a GrammarManager of this rank needs from the runtime (also for benchmarks
        that swap backends): how to abort a request, and the live poll settings."""
        return {"abort_request": abort_for_grammar, "polling": grammar_polling,
                "log_prefix": self.rank_info.log_prefix}

    # ---- input -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending_outputs or self.control_outputs
                    or self.grammar_manager.grammar_queue)

    def process_input_requests(self, msgs: list[Message]) -> None:
        for m in msgs:
            if isinstance(m, TokenizedGenerateReq):
                self._add_request(m)
            elif isinstance(m, AbortReq):
                self._abort(m)
            elif isinstance(m, FlushCacheReq):
                self.control_outputs.append(self.flush_cache(m.rid))
            else:
                logger.error("%s ignoring unknown message %r", self.rank_info.log_prefix, type(m))

    def _add_request(self, m: TokenizedGenerateReq) -> None:
        if m.rid in self.reqs:
            logger.warning("%s duplicate request id %s ignored", self.rank_info.log_prefix, m.rid)
            return
        n, ctx = len(m.input_ids), self.runner.context_len
        params = m.sampling_params
        if n + params.max_new_tokens > ctx:  # clip like SGLang: never run past the context
            params = dataclasses.replace(params, max_new_tokens=max(ctx - n, 0))
        req = Req(m.rid, m.input_ids, params, m.stream, self.eos_ids, m.require_reasoning,
                  m.logprobs, m.prefix_group)
        error = self._validate(req)
        if error is not None:
            req.finished_reason = FinishReason("abort", message=error, status_code=400)
        elif self._queue_full():
            limit = self.server_args.max_queued_requests
            req.finished_reason = FinishReason(
                "abort", status_code=503,
                message=f"The server's queue is full ({limit} requests waiting, --max-queued-requests); "
                        "retry later.")
        elif params.max_new_tokens == 0 and req.input_logprobs_done:
            req.finished_reason = FinishReason("length", matched=0)  # nothing to compute
        elif params.grammar_key is not None:  # a constraint, or a thinking_budget
            if self.grammar_manager.process_req_with_grammar(req):
                self.reqs[req.rid] = req  # waits in the grammar queue
                return
        if req.finished:
            self.pending_outputs.append(req)
            return
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def _queue_full(self) -> bool:
        """Identical on every rank: the queues are (accepted requests are never dropped)."""
        limit = self.server_args.max_queued_requests
        return limit is not None and len(self.waiting) + len(self.grammar_manager.grammar_queue) >= limit

    def _validate(self, req: Req) -> Optional[str]:
        n, ctx = len(req.origin_input_ids), self.runner.context_len
        if n == 0:
            return "The input is empty."
        if n >= ctx:
            return f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
        if n + 1 > self.kv.allocator.size:
            return (f"The input ({n} tokens) can never fit in the KV cache "
                    f"(max_total_tokens={self.kv.allocator.size}).")
        if not all(type(t) is int and 0 <= t < self.vocab_size for t in req.origin_input_ids):
            return f"Input token ids must be in [0, {self.vocab_size})."
        return None

    def _abort(self, m: AbortReq) -> None:
        req = self.reqs.pop(m.rid, None)
        if req is None:
            return  # already finished: its final output was sent
        if req in self.running:
            self._keep_running([r for r in self.running if r is not req])
        elif not self.grammar_manager.abort(req):
            self.waiting.remove(req)
        self.kv.release(req)
        req.finished_reason = FinishReason("abort", message=m.message, status_code=m.status_code)
        self.pending_outputs.append(req)

    def flush_cache(self, rid: str = "") -> FlushCacheOut:
        """Every rank sees the same message at the same point, so all flush or none does."""
        if self.running or self.waiting or self.grammar_manager.grammar_queue:
            return FlushCacheOut(rid, False, "Cache not flushed: requests are running or waiting.")
        if not self.kv.flush_cache():
            return FlushCacheOut(rid, False, "Cache not flushed: part of it is in use.")
        return FlushCacheOut(rid, True, "Cache flushed." if self.kv.tree else "The radix cache is disabled.")

    def collect_timeouts(self) -> list[AbortReq]:
        """Entry rank only: wall-clock timeouts become aborts broadcast with the inputs."""
        out = []
        now = time.monotonic()
        wait_limit = environ.SGLANG_REQ_WAITING_TIMEOUT.get()
        run_limit = environ.SGLANG_REQ_RUNNING_TIMEOUT.get()
        if wait_limit > 0:
            out += [AbortReq(r.rid, f"Request waited more than {wait_limit} s in the queue "
                             "(SGLANG_REQ_WAITING_TIMEOUT).", 503)
                    for r in list(self.waiting) + self.grammar_manager.grammar_queue
                    if r.first_scheduled_time is None and now - r.arrival_time > wait_limit]
        if run_limit > 0:
            out += [AbortReq(r.rid, f"Request ran more than {run_limit} s "
                             "(SGLANG_REQ_RUNNING_TIMEOUT).", 503)
                    for r in self.running + list(self.waiting)
                    if r.first_scheduled_time is not None and now - r.first_scheduled_time > run_limit]
        return out

    # ---- one iteration -----------------------------------------------------------------
    def step(self) -> list[Union[BatchTokenOut, FlushCacheOut]]:
        self.step_stats.start_step()
        self._poll_grammars()
        switched = self.runner.compiled_switch.agree()  # TP > 1: every rank in this step
        if switched is not None:
            self.batch_log.record_compiled(*switched)
        touched = self.pending_outputs
        self.pending_outputs = []
        control, self.control_outputs = self.control_outputs, []
        batch = self._get_next_batch_to_run()
        if batch is None:
            return control + self._make_outputs(touched)
        mode, reqs = batch
        if self.metrics_reporter is not None:
            self.metrics_reporter.before_batch(mode is not ForwardMode.DECODE, reqs)
        timed = mode is ForwardMode.DECODE and self.step_cost is not None
        rows = sum(r.decode_rows for r in reqs) if timed else 0
        self._run_batch(mode, reqs)  # a prefill chunk leaves reqs: it has no output yet
        if self.metrics_reporter is not None:
            self.metrics_reporter.after_batch(reqs)
        outputs = control + self._make_outputs(touched + reqs)
        self.step_stats.end_step(mode.name)  # the rest of the step counts as "scheduler"
        if timed:
            self._observe_decode_cost(rows, self.step_stats.step_seconds())
        return outputs

    def _poll_grammars(self) -> None:
        """Agreed-ready constrained requests join the waiting queue; agreed-failed ones end."""
        idle = not (self.running or self.waiting)  # identical on every rank
        ready, failed = self.grammar_manager.get_ready_grammar_requests(idle)
        self.waiting.extend(ready)
        for req in failed:
            self.reqs.pop(req.rid, None)
            self.pending_outputs.append(req)

    def _get_next_batch_to_run(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        mixed = self.mixed_chunk and bool(self.running)
        if self._decode_next:  # alternate chunks with decode steps: no decode starves
            self._decode_next = False
            batch = self._decode_batch() if self.running and not mixed else None
            if batch is not None:
                return batch
        if mixed:  # the running requests' slots first: they decode in the same forward
            self._ensure_decode_capacity()
            mixed = bool(self.running)
        adder = PrefillAdder(self.running, self.kv.available_tokens(),
                             self.runner.max_running_requests,
                             self.server_args.max_prefill_tokens, self.clip_new_tokens,
                             self.chunk_size, share_prompts=self.kv.tree is not None,
                             share_scores=self.kv.logprob_pool is not None)
        new_reqs = adder.select(self.waiting, self.kv.lock_prefix, self.kv.unlock_prefix)
        if new_reqs:
            for _ in new_reqs:
                self.waiting.popleft()
            if mixed:
                return ForwardMode.MIXED, list(self.running) + new_reqs
            return ForwardMode.EXTEND, new_reqs
        return self._decode_batch() if self.running else None

    def _decode_batch(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        self._ensure_decode_capacity()
        return (ForwardMode.DECODE, list(self.running)) if self.running else None

    def _ensure_decode_capacity(self) -> None:
        """Each decode step needs a slot per row (one per request, more after a fast-forward
        or with drafts): drop the drafts first, then retract the newest if short."""
        if sum(r.decode_rows for r in self.running) > self.kv.available_tokens():
            for r in self.running:
                if r.spec is not None:
                    r.spec.clear_draft()
        while self.running and self.kv.available_tokens() < sum(r.uncomputed_tokens for r in self.running):
            req = self.running[-1]
            self._keep_running(self.running[:-1])
            self.kv.release(req)
            if not self.running and req.seqlen + 1 > self.kv.allocator.size:
                req.finished_reason = FinishReason(
                    "abort", status_code=503,
                    message=f"KV cache exhausted (max_total_tokens={self.kv.allocator.size}).")
                self.reqs.pop(req.rid, None)
                self.pending_outputs.append(req)
                return
            logger.info("%s KV cache full: retracting %s", self.rank_info.log_prefix, req.rid)
            self.num_retractions += 1
            self.waiting.appendleft(req)

    def _keep_running(self, kept: list[Req]) -> None:
        """Shrink `running` to `kept` (a subsequence) and its sampling state with it."""
        if len(kept) == len(self.running):
            return
        if not kept:
            self.running, self.running_info = [], None
            return
        pos = {id(r): i for i, r in enumerate(self.running)}
        self.running_info.filter_batch([pos[id(r)] for r in kept])
        self.running = kept

    def _make_outputs(self, reqs: list[Req]) -> list[BatchTokenOut]:
        interval = self.server_args.stream_interval
        picked = [r for r in reqs if r.finished or
                  (r.stream and len(r.output_ids) - r.sent_len >= interval)]
        if not picked:
            return []
        deltas, out_lps, in_lps = [], [], []
        for r in picked:
            out_lp, in_lp = take_logprob_deltas(r)
            out_lps.append(out_lp)
            in_lps.append(in_lp)
            deltas.append(tuple(r.output_ids[r.sent_len:]))
            r.sent_len = len(r.output_ids)
        any_lp = any(lp is not None for lp in out_lps)
        reports = tuple(r.grammar_report if r.finished else None for r in picked)
        return [BatchTokenOut(
            rids=tuple(r.rid for r in picked),
            new_token_ids=tuple(deltas),
            finished_reasons=tuple(r.finished_reason for r in picked),
            prompt_tokens=tuple(len(r.origin_input_ids) for r in picked),
            completion_tokens=tuple(len(r.output_ids) for r in picked),
            cached_tokens=tuple(r.cached_tokens or 0 for r in picked),
            fast_forward_tokens=tuple(r.fast_forward_tokens for r in picked),
            spec_verify_ct=(tuple(r.spec.verify_ct if r.spec else 0 for r in picked)
                            if self.spec_config is not None else ()),
            output_logprobs=tuple(out_lps) if any_lp else (),
            input_logprobs=tuple(in_lps) if any_lp else (),
            grammar_reports=reports if any(reports) else (),
        )]

    # ---- loop ------------------------------------------------------------------------
    def event_loop(self, recv: Callable[[bool, list], list[Message]],
                   send: Callable[[BatchTokenOut], None], on_iteration: Callable[[], None]) -> None:
        """``recv(block, extra)`` returns this iteration's messages, identical on all ranks."""
        while True:
            on_iteration()
            extra = self.collect_timeouts() if self.rank_info.is_entry_rank else []
            self.process_input_requests(recv(not self.has_work(), extra))
            for out in self.step():
                send(out)
            if self.metrics_reporter is not None:
                self.metrics_reporter.maybe_send(self, send)
            if not self.has_work():
                self.kv.check_idle_integrity()


def abort_for_grammar(req: Req, message: str) -> None:
    req.finished_reason = FinishReason("abort", message=message, status_code=400)


def grammar_polling() -> GrammarPolling:
    """Read on every poll, so a changed environment takes effect (tests rely on it)."""
    return GrammarPolling(environ.SGLANG_GRAMMAR_POLL_INTERVAL.get(),
                          environ.SGLANG_GRAMMAR_MAX_POLL_ITERATIONS.get())


def resolve_chunk_size(configured: Optional[int], device: str) -> Optional[int]:
    """--chunked-prefill-size: None -> the device's default (docs/speed.md "Chunked prefill"),
    -1 -> no chunking."""
    if configured is None:
        return 256 if device == "cpu" else 8192
    return None if configured == -1 else configured
