"""The scheduler every rank runs: the same loop, in the same order, on identical inputs.

Per iteration: receive (entry rank) and broadcast new requests and aborts -> poll grammar
compiles and agree on them (GrammarManager) -> pick a prefill or decode batch under the token and KV
budgets -> forward -> sample -> append tokens, check stop conditions, free finished
requests -> the entry rank sends outputs to the frontend.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Union

import torch

from constrained.grammar_manager import GrammarManager, GrammarPolling
from constrained.registry import create_grammar_backend
from distributed.parallel_state import RankInfo, TPGroup
from distributed.token_agreement import agree_on_sampled_ids
from sampling.sampling_batch_info import SamplingBatchInfo
from srt import environ
from srt.forward_batch import ForwardMode
from srt.managers.batch_log import BatchLog
from srt.managers.logprob_tracker import (logprob_rows, plan_prompt_logprobs, record_output_logprobs,
                                          record_prompt_logprobs, take_logprob_deltas)
from srt.managers.io_struct import (AbortReq, BatchTokenOut, FinishReason, FlushCacheOut, FlushCacheReq,
                                   TokenizedGenerateReq)
from srt.managers.req import Req
from srt.managers.schedule_batch import KVCacheManager
from srt.managers.schedule_policy import PrefillAdder
from srt.managers.step_stats import StepStats
from srt.mem_cache.radix_cache import RadixCache
from srt.metrics.scheduler_reporter import SchedulerMetricsReporter
from srt.model_config import ModelConfig
from srt.model_runner import ModelRunner
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
Message = Union[TokenizedGenerateReq, AbortReq, FlushCacheReq]


class Scheduler:
    def __init__(self, server_args: ServerArgs, rank_info: RankInfo, tp: TPGroup,
                 model_config: ModelConfig, tokenizer=None, batch_log: Optional[BatchLog] = None):
        self.server_args = server_args
        self.rank_info = rank_info
        self.tp = tp
        self.batch_log = batch_log or BatchLog(None)
        self.model_config = model_config
        self.tokenizer = tokenizer  # only for stop strings
        self.runner = ModelRunner(server_args, model_config, rank_info, tp)
        r = self.runner
        tree = None if server_args.disable_radix_cache else RadixCache(
            r.token_to_kv_pool_allocator.free, r.device)
        self.kv = KVCacheManager(r.req_to_token_pool, r.token_to_kv_pool_allocator,
                                 r.token_to_kv_pool, r.device, tree)
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
        backend = create_grammar_backend(server_args, tokenizer, self.vocab_size,
                                         tuple(model_config.eos_token_ids))
        self.grammar_manager = GrammarManager(backend, tp, **self.grammar_manager_kwargs())
        # Decode steps fill their grammar bitmask on this thread while the forward runs.
        self.mask_executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        # Seconds spent filling / applying grammar masks, for benchmarks and logs: the fill
        # as waited for on the critical path, and as worked (overlapped or not).
        self.mask_fill_seconds = self.mask_fill_work_seconds = self.mask_apply_seconds = 0.0
        self.mask_steps = 0
        # Grammar fast-forward: forced tokens are appended without a decode step each and
        # ride along as extra rows of the next decode step, up to this many rows in all
        # (the compiled step's / CUDA graphs' largest batch: more would run it eagerly).
        self.fast_forward = not server_args.disable_grammar_fast_forward
        graph = r.compiled_decode or r.cuda_graph_runner
        self.decode_row_limit = graph.max_bs if graph is not None else server_args.torch_compile_max_bs
        self.fast_forward_tokens = 0  # appended so far, for benchmarks and logs
        # Token agreement (TP > 1, batches with grammars): rows where this rank's own
        # sample differed from the agreed one. Expected to stay 0; measured, not assumed.
        self.token_agreement_steps = self.token_mismatches = 0
        self.step_stats = StepStats()  # per-phase seconds, for the benchmark breakdown
        # --enable-metrics, entry rank only: throttled SchedulerMetrics to the frontend.
        self.metrics_reporter = SchedulerMetricsReporter.create(server_args, rank_info)

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
        elif params.constraint is not None:
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
        start = time.perf_counter()
        self._poll_grammars()
        touched = self.pending_outputs
        self.pending_outputs = []
        control, self.control_outputs = self.control_outputs, []
        batch = self._get_next_batch_to_run()
        if batch is None:
            return control + self._make_outputs(touched)
        mode, reqs = batch
        if self.metrics_reporter is not None:
            self.metrics_reporter.before_batch(mode is ForwardMode.EXTEND, reqs)
        timed = self._run_batch(mode, reqs)
        if self.metrics_reporter is not None:
            self.metrics_reporter.after_batch(reqs)
        outputs = control + self._make_outputs(touched + reqs)
        times = self.step_stats.mode(mode.name)
        times.steps += 1
        # Whatever the timed phases did not take: batching, bookkeeping, outputs.
        times.add("scheduler", time.perf_counter() - start - timed)
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
        if self._decode_next:  # alternate chunks with decode steps: no decode starves
            self._decode_next = False
            batch = self._decode_batch() if self.running else None
            if batch is not None:
                return batch
        adder = PrefillAdder(self.running, self.kv.available_tokens(),
                             self.server_args.max_running_requests,
                             self.server_args.max_prefill_tokens, self.clip_new_tokens,
                             self.chunk_size, share_prompts=self.kv.tree is not None)
        new_reqs = adder.select(self.waiting, self.kv.lock_prefix, self.kv.unlock_prefix)
        if new_reqs:
            for _ in new_reqs:
                self.waiting.popleft()
            return ForwardMode.EXTEND, new_reqs
        return self._decode_batch() if self.running else None

    def _decode_batch(self) -> Optional[tuple[ForwardMode, list[Req]]]:
        self._ensure_decode_capacity()
        return (ForwardMode.DECODE, list(self.running)) if self.running else None

    def _ensure_decode_capacity(self) -> None:
        """Each decode step needs a slot per uncomputed token (one per request, more after
        a fast-forward): retract the newest if short."""
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

    def _run_batch(self, mode: ForwardMode, reqs: list[Req]) -> float:
        """Run one batch; returns the seconds it added to the forward/sampling/grammar phases."""
        prompt_plan = []
        if mode is ForwardMode.EXTEND:
            fb = self.kv.prepare_extend(reqs)
            fb.logit_rows, prompt_plan = plan_prompt_logprobs(reqs, fb.extend_seq_lens_cpu,
                                                              fb.extend_prefix_lens_cpu)
            now = time.monotonic()
            for r in reqs:
                r.first_scheduled_time = r.first_scheduled_time or now
        else:
            counts = [r.uncomputed_tokens for r in reqs]
            fb = self.kv.prepare_decode(reqs)
            # The grammars are settled until this step's tokens are accepted: fill their
            # bitmask while the forward runs.
            self.running_info.start_vocab_mask_fill(self.mask_executor)
        self.batch_log.record(mode.name, (r.rid for r in reqs))
        times = self.step_stats.mode(mode.name)
        t0 = time.perf_counter()
        logits = self.runner.forward(fb)
        if prompt_plan:  # rows past the batch's last-per-sequence ones: prompt logprobs
            record_prompt_logprobs(prompt_plan, logits[len(reqs):], self.rank_info.is_entry_rank)
            logits = logits[:len(reqs)].float()  # rows came in the model's dtype
        if mode is ForwardMode.DECODE and fb.batch_size != len(reqs):
            # Fast-forwarded requests fed several rows: sample from each one's last row.
            logits = logits[torch.tensor(counts).cumsum(0) - 1]
        t1 = time.perf_counter()
        if mode is ForwardMode.EXTEND and reqs[-1].extend_limit is not None:
            # Mid-prefill: no token (its grammar and sampling state see nothing); it goes
            # back to the queue's front, and the running requests decode next.
            chunked = reqs.pop()
            chunked.extend_limit = None
            self.waiting.appendleft(chunked)
            self._decode_next = True
            logits = logits[:len(reqs)]
            if not reqs:
                times.add("forward", t1 - t0)
                return t1 - t0
        if mode is ForwardMode.EXTEND:
            scored = [i for i, r in enumerate(reqs) if r.sampling_params.max_new_tokens == 0]
            if scored:  # prompt scoring (max_new_tokens 0): done once the prompt is prefilled
                reqs, logits = self._finish_scored(reqs, scored, logits)
                if not reqs:
                    times.add("forward", t1 - t0)
                    return t1 - t0
            info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.runner.device,
                                               self.generator)
        else:
            info = self.running_info
            assert info is not None and len(info) == len(reqs), "sampling state out of step"
        lp_rows = logprob_rows(reqs, self.rank_info.is_entry_rank)
        next_ids, logprobs = self.runner.sample(logits, info, lp_rows)
        has_grammar = any(g is not None for g in info.grammars)
        if not self.tp.is_single and has_grammar:
            # Same decision on every rank (identical batch): grammars must see one token.
            next_ids, mismatches = agree_on_sampled_ids(next_ids, self.tp)
            self.token_agreement_steps += 1
            self.batch_log.record_agreement(mismatches)
            if mismatches:
                self.token_mismatches += mismatches
                logger.warning("%s %d sampled token(s) differed from the TP group's agreed ids",
                               self.rank_info.log_prefix, mismatches)
        if info.vocab_mask is not None:
            self.mask_fill_seconds += info.mask_fill_seconds
            self.mask_fill_work_seconds += info.mask_fill_work_seconds
            self.mask_apply_seconds += info.mask_apply_seconds
            self.mask_steps += 1
        info.cumulate_output_tokens(next_ids)
        record_output_logprobs(reqs, lp_rows, logprobs, next_ids)
        t3 = time.perf_counter()
        failed = info.take_failed_rows()
        forced_rows, forced_ids = [], []
        rows_left = self.decode_row_limit - len(reqs) - (len(self.running) if mode is ForwardMode.EXTEND else 0)
        for i, (r, tok) in enumerate(zip(reqs, next_ids.tolist())):
            if i not in failed:  # a failed row's token is never used
                r.output_ids.append(tok)
                message = self._accept_into_grammar(r, tok)
                failed[i] = None if message is None else (message, 500)
            if failed[i] is None:
                r.check_finished(self.tokenizer)
                # Forced tokens have no distribution of their own: no fast-forward for
                # requests that asked for logprobs.
                if (self.fast_forward and r.grammar is not None and rows_left > 0
                        and not r.finished and not r.return_logprob):
                    forced, failed[i] = self._fast_forward(r, rows_left)
                    rows_left -= len(forced)
                    forced_rows += [i] * len(forced)
                    forced_ids += forced
            if failed[i] is not None:
                message, status = failed[i]
                logger.warning("%s aborting %s: %s", self.rank_info.log_prefix, r.rid, message)
                r.finished_reason = FinishReason("abort", message=message, status_code=status)
            if r.finished:
                if r.grammar is not None:
                    r.grammar.finished = True
                self.kv.release(r)
                self.reqs.pop(r.rid, None)
        info.cumulate_forced_tokens(forced_rows, forced_ids)
        if forced_rows:
            self.batch_log.record_forced(forced_rows, forced_ids)
        fill = info.mask_fill_seconds if info.vocab_mask is not None else 0.0
        grammar = fill + (time.perf_counter() - t3 if has_grammar else 0.0)
        # Sampling includes applying the mask; filling it is grammar work.
        phases = {"forward": t1 - t0, "sampling": t3 - t1 - fill, "grammar": grammar}
        for phase, secs in phases.items():
            times.add(phase, secs)
        timed = sum(phases.values())
        keep = [i for i, r in enumerate(reqs) if not r.finished]
        if mode is ForwardMode.EXTEND:
            for i in keep:  # their prompts' KV is shared from now on, not only after they finish
                self.kv.cache_prefilled(reqs[i])
        if self.kv.tree is not None:  # the tree as this batch left it
            self.batch_log.record_cache(self.kv.tree.digest, self.kv.tree.evicted_tokens)
        if mode is ForwardMode.DECODE:
            self._keep_running([r for r in self.running if not r.finished])
            return timed
        if not keep:
            return timed
        if len(keep) < len(reqs):
            info.filter_batch(keep)
        self.running.extend(reqs[i] for i in keep)
        if self.running_info is None:
            self.running_info = info
        else:
            self.running_info.merge_batch(info)
        return timed

    def _finish_scored(self, reqs: list[Req], scored: list[int], logits: torch.Tensor
                       ) -> tuple[list[Req], torch.Tensor]:
        """Finish requests that only score their prompt (its logprobs were recorded by
        this prefill); they sample nothing. Returns the rest of the batch and its logits.
        ``reqs`` itself is left whole: the step reports every request in it."""
        for i in scored:
            r = reqs[i]
            r.finished_reason = FinishReason("length", matched=0)
            if r.grammar is not None:
                r.grammar.finished = True
            self.kv.release(r)
            self.reqs.pop(r.rid, None)
        done = set(scored)
        keep = [i for i in range(len(reqs)) if i not in done]
        return [reqs[i] for i in keep], logits[torch.tensor(keep, dtype=torch.int64)]

    @staticmethod
    def _accept_into_grammar(req: Req, token: int) -> Optional[str]:
        """Advance the request's grammar; an error message if it rejects the token."""
        if req.grammar is None:
            return None
        try:
            req.grammar.accept_token(token)
        except Exception as e:  # aborts this request only
            return f"Grammar rejected the sampled token {token}: {e}"
        return None

    def _fast_forward(self, req: Req, max_rows: int) -> tuple[list[int], Optional[tuple[str, int]]]:
        """Append the tokens the request's grammar forces next; their KV is computed by the
        next decode step. A pure function of grammar state and counts every rank shares, so
        ranks force the same tokens. Returns (appended tokens, failure or None)."""
        budget = min(req.remaining_new_tokens(), max_rows)
        try:
            forced = req.grammar.fast_forward(budget)
        except Exception as e:  # a library bug aborts this request only
            return [], (f"Grammar fast-forward failed: {type(e).__name__}: {e}", 500)
        appended = []
        for k, tok in enumerate(forced):
            req.output_ids.append(tok)
            appended.append(tok)
            if k + 1 < len(forced) and req.grammar.is_terminated():
                continue  # the grammar took them all (llguidance): it ends after the last one
            req.check_finished(self.tokenizer)  # a stop string may end inside forced text
            if req.finished:
                break
        req.fast_forward_tokens += len(appended)
        self.fast_forward_tokens += len(appended)
        return appended, None

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
    """--chunked-prefill-size: None -> the device's default (README "Chunked prefill"),
    -1 -> no chunking."""
    if configured is None:
        return 256 if device == "cpu" else 8192
    return None if configured == -1 else configured
