"""One batch through the model, phase by phase (the scheduler's ``_run_batch``):

prepare (KV slots, the prompt-logprob plan; a decode's grammar mask fill starts here and
overlaps the forward) -> forward -> sample (TP ranks agree on the token when grammars are
in the batch) -> process results (grammar accept, fast-forward, finish and release) ->
update the running set (prefilled prompts enter the prefix cache).

A MIXED batch (--enable-mixed-chunk) is two BatchSteps sharing one forward: the running
requests' decode part, then the new requests' prefill part; each goes through sampling,
results and the running-set update as its own step would, decode part first.

Every rank runs the same phases on the same batch; ``StepStats`` times them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from distributed.pipeline import broadcast_sampled_ids
from distributed.token_agreement import agree_on_sampled_ids
from sampling.sampling_batch_info import SamplingBatchInfo
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.transport.io_struct import FinishReason
from srt.scheduler.logprob_tracker import (PromptLogprobRows, logprob_rows, plan_prompt_logprobs,
                                          record_output_logprobs, record_prompt_logprobs)
from srt.scheduler.req import Req
from srt.scheduler.spec_step import SpecStepMixin

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchStep:
    """One batch on its way through the phases; each phase fills in its part."""
    mode: ForwardMode
    reqs: list[Req]  # the caller's list or its part of it (a chunk is popped), then those that sample
    fb: ForwardBatch
    prompt_plan: list[PromptLogprobRows] = field(default_factory=list)
    row_counts: Optional[list[int]] = None  # decode: rows per request (> 1 after a fast-forward)
    drafts: Optional[list[list[int]]] = None  # decode: each request's drafted tokens (verified)
    logits: Optional[torch.Tensor] = None  # one row per request, to sample from
    info: Optional[SamplingBatchInfo] = None
    next_ids: Optional[torch.Tensor] = None
    tokens: Optional[list[list[int]]] = None  # per request: the tokens to append, in order
    accepted: Optional[list[int]] = None  # with drafts, per request: n-gram drafts kept
    kv_valid: Optional[list[int]] = None  # with drafts: leading tokens whose KV was computed
    has_grammar: bool = False  # any request in the batch has one: its time counts as grammar
    chunked: bool = False  # a prefill whose last request was a mid-prompt chunk (it left)

    @property
    def mask_fill_seconds(self) -> float:
        """Waiting for the grammar mask's fill (started before the forward)."""
        return self.info.mask_fill_seconds if self.info.vocab_mask is not None else 0.0


class BatchStepMixin(SpecStepMixin):
    """``Scheduler``'s batch phases. They use its kv, runner, tp, rank_info, batch_log,
    step_stats, generator, mask_executor, tokenizer, vocab_size, fast-forward settings,
    request sets (waiting, running, running_info, reqs), ``routing_digest`` and ``_keep_running``."""

    def _run_batch(self, mode: ForwardMode, reqs: list[Req]) -> None:
        """prepare -> forward -> sample -> process results -> update the running set.
        A prefill chunk leaves ``reqs`` (the caller's list): it has no output this step.
        MIXED (``reqs``: the running requests, then new ones): one forward, then the decode
        part and the prefill part go through the later phases in that order."""
        stats = self.step_stats
        steps, fb = self._prepare(mode, reqs)
        with stats.phase("forward"):
            self._forward(steps, fb)
        if self.routing_digest is not None:
            self.batch_log.record_routing(self.routing_digest.pop())
        for step in steps:
            with stats.phase("sampling") as sampling:
                if not self._drop_unsampled(step):  # nothing to sample: only the forward is timed
                    sampling.cancel()
                    continue
                self._sample(step)
            # Filling the mask is grammar work (applying it is sampling).
            stats.move("sampling", "grammar", step.mask_fill_seconds)
            with stats.phase("grammar", counted=step.has_grammar):
                self._process_results(step)
            self._update_running(step)
        if self.kv.tree is not None:  # the tree as this batch left it (scoring ones too)
            self.batch_log.record_cache(self.kv.tree.digest, self.kv.tree.evicted_tokens)
        if mode is ForwardMode.MIXED and steps[-1].chunked:
            reqs.pop()  # the chunked request, last in the caller's list too

    def _prepare(self, mode: ForwardMode, reqs: list[Req]) -> tuple[list[BatchStep], ForwardBatch]:
        """KV slots and the forward batch (a prefill's with the rows prompt logprobs need);
        one BatchStep per part of it."""
        n = len(reqs) if mode is ForwardMode.DECODE else len(self.running) if mode is ForwardMode.MIXED else 0
        counts = [r.decode_rows for r in reqs[:n]]  # decode rows per request, before their KV slots
        drafts = [list(r.draft_ids) for r in reqs[:n]]
        if mode is ForwardMode.EXTEND:
            fb = self.kv.prepare_extend(reqs)
            steps = [self._extend_step(reqs, fb)]
        elif mode is ForwardMode.DECODE:
            fb = self.kv.prepare_decode(reqs)
            steps = [self._decode_step(reqs, fb, counts, drafts)]
        else:
            fb = self.kv.prepare_mixed(reqs[:n], reqs[n:])
            steps = [self._decode_step(reqs[:n], fb.decode_part, counts, drafts),
                     self._extend_step(reqs[n:], fb.extend_part)]
        if any(drafts):  # hybrid models keep each row's state, to undo rejected drafts
            (fb.decode_part or fb).keep_row_states = True
        self.batch_log.record(mode.name, (r.rid for r in reqs))
        return steps, fb

    def _extend_step(self, reqs: list[Req], fb: ForwardBatch) -> BatchStep:
        fb.logit_rows, plan = plan_prompt_logprobs(reqs, fb.extend_seq_lens_cpu,
                                                   fb.extend_prefix_lens_cpu)
        now = time.monotonic()
        for r in reqs:
            r.first_scheduled_time = r.first_scheduled_time or now
        return BatchStep(ForwardMode.EXTEND, reqs, fb, prompt_plan=plan)

    def _decode_step(self, reqs: list[Req], fb: ForwardBatch, counts: list[int],
                     drafts: list[list[int]]) -> BatchStep:
        # The grammars are settled until this step's tokens are accepted: fill their
        # bitmask while the forward runs.
        self.running_info.start_vocab_mask_fill(self.mask_executor)
        return BatchStep(ForwardMode.DECODE, reqs, fb, row_counts=counts,
                         drafts=drafts if any(drafts) else None)

    def _forward(self, steps: list[BatchStep], fb: ForwardBatch) -> None:
        """The model's forward; each part takes its rows of the logits."""
        logits = self.runner.forward(fb)
        if fb.mode is ForwardMode.MIXED:
            d = fb.decode_part.batch_size  # decode rows come first
            self._take_logits(steps[0], logits[:d])
            self._take_logits(steps[1], logits[d:])
        else:
            self._take_logits(steps[0], logits)

    def _take_logits(self, step: BatchStep, logits: torch.Tensor) -> None:
        """Prompt logprobs are recorded; one float32 logits row per request is kept."""
        n = len(step.reqs)
        if step.prompt_plan:  # rows past the batch's last-per-sequence ones: prompt logprobs
            record_prompt_logprobs(step.prompt_plan, logits[n:], self.rank_info.is_entry_rank)
            logits = logits[:n]
        logits = logits.float()  # rows came in the model's dtype with prompt logprobs (no-op else)
        if step.drafts is not None:  # each request's last 1 + len(draft) rows are sampled
            ends = torch.tensor(step.row_counts).cumsum(0).tolist()
            logits = logits[torch.tensor([e - len(d) - 1 + j for e, d in zip(ends, step.drafts)
                                          for j in range(len(d) + 1)])]
        elif step.mode is ForwardMode.DECODE and step.fb.batch_size != n:
            # Fast-forwarded requests fed several rows: sample from each one's last row.
            logits = logits[torch.tensor(step.row_counts).cumsum(0) - 1]
        step.logits = logits

    def _drop_unsampled(self, step: BatchStep) -> bool:
        """Requests that sample nothing leave the batch: a prefill's mid-prompt chunk and
        its prompt-scoring requests. False when nothing is left to sample."""
        if step.mode is not ForwardMode.EXTEND:
            return True
        reqs = step.reqs
        if reqs[-1].extend_limit is not None:
            # Mid-prefill: no token (its grammar and sampling state see nothing); it goes
            # back to the queue's front, and the running requests decode next.
            chunked = reqs.pop()
            chunked.extend_limit = None
            self.waiting.appendleft(chunked)
            step.chunked = True
            self._decode_next = True
            step.logits = step.logits[:len(reqs)]
            if not reqs:
                return False
        scored = [i for i, r in enumerate(reqs) if r.sampling_params.max_new_tokens == 0]
        if scored:  # prompt scoring (max_new_tokens 0): done once the prompt is prefilled
            step.reqs, step.logits = self._finish_scored(reqs, scored, step.logits)
        return bool(step.reqs)

    def _finish_scored(self, reqs: list[Req], scored: list[int], logits: torch.Tensor
                       ) -> tuple[list[Req], torch.Tensor]:
        """Finish requests that only score their prompt (its logprobs were recorded by
        this prefill); they sample nothing. Returns the rest of the batch and its logits.
        ``reqs`` itself is left whole: the step reports every request in it."""
        for i in scored:
            reqs[i].finished_reason = FinishReason("length", matched=0)
            self._release_finished(reqs[i])
        done = set(scored)
        keep = [i for i in range(len(reqs)) if i not in done]
        return [reqs[i] for i in keep], logits[torch.tensor(keep, dtype=torch.int64)]

    def _sample(self, step: BatchStep) -> None:
        """Each request's next token (and logprobs, when asked); with grammars in the batch,
        TP ranks agree on one token per row. With drafts, every drafted position is
        sampled (spec_step.py)."""
        if step.drafts is not None:
            self._sample_drafts(step)
            return
        reqs = step.reqs
        if step.mode is ForwardMode.EXTEND:
            info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.runner.device,
                                               self.generator)
        else:
            info = self.running_info
            assert info is not None and len(info) == len(reqs), "sampling state out of step"
        lp_rows = logprob_rows(reqs, self.rank_info.is_entry_rank)
        step.has_grammar = any(g is not None for g in info.grammars)
        if self.pipeline is not None:
            next_ids, logprobs = self._sample_in_pipeline(step.logits, info, lp_rows, step.has_grammar)
        else:
            next_ids, logprobs = self.runner.sample(step.logits, info, lp_rows, check_first=True)
            if not self.tp.is_single and step.has_grammar:
                next_ids = self._agree_on_tokens(next_ids)
        self.step_stats.count_mask(info)
        info.cumulate_output_tokens(next_ids)
        record_output_logprobs(reqs, lp_rows, logprobs, next_ids)
        step.info, step.next_ids = info, next_ids
        step.tokens = [[t] for t in next_ids.tolist()]

    def _sample_in_pipeline(self, logits: torch.Tensor, info: SamplingBatchInfo, lp_rows: list[int],
                            has_grammar: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """--pp-size > 1: the last stage samples, and every rank takes the entry rank's ids
        (one broadcast over the DP group, every step: every stage appends them). The other
        stages fill the same grammar mask without applying it: a dead end found there
        fails the row on every stage alike."""
        if self.pipeline.is_last:
            next_ids, logprobs = self.runner.sample(logits, info, lp_rows)
        else:
            info.update_regex_vocab_mask()
            next_ids, logprobs = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device), None
        next_ids, mismatches = broadcast_sampled_ids(next_ids, self.pipeline)
        if has_grammar:
            self.step_stats.count_agreement(mismatches)
            self.batch_log.record_agreement(mismatches)
        if mismatches:
            logger.warning("%s %d sampled token(s) differed from the entry rank's",
                           self.rank_info.log_prefix, mismatches)
        return next_ids, logprobs

    def _agree_on_tokens(self, next_ids: torch.Tensor) -> torch.Tensor:
        """Same decision on every rank (identical batch): grammars must see one token."""
        next_ids, mismatches = agree_on_sampled_ids(next_ids, self.tp)
        self.step_stats.count_agreement(mismatches)
        self.batch_log.record_agreement(mismatches)
        if mismatches:
            logger.warning("%s %d sampled token(s) differed from the TP group's agreed ids",
                           self.rank_info.log_prefix, mismatches)
        return next_ids

    def _process_results(self, step: BatchStep) -> None:
        """Per request: its tokens are appended one by one (its grammar accepts each, stop
        conditions are checked after each), the KV of drafted positions not kept is freed,
        then the tokens its grammar forces are fast-forwarded and its next tokens drafted;
        finished requests are released."""
        reqs, info = step.reqs, step.info
        failed = info.take_failed_rows()
        forced_rows, forced_ids = [], []
        batch = len(reqs) + (len(self.running) if step.mode is ForwardMode.EXTEND else 0)
        rows_left = self.decode_row_limit - batch
        spec_rows = (self.spec_config.max_rows - batch) if self.spec_config is not None else 0
        drafters = []  # drafting comes after every request's forced tokens took their rows
        for i, (r, tokens) in enumerate(zip(reqs, step.tokens)):
            start = r.seqlen  # the first token's position
            appended = 0
            if i not in failed:  # a failed row's tokens are never used
                appended, failed[i] = self._append_tokens(r, tokens)
            if step.drafts is not None:  # KV beyond what was kept: freed now, never cached
                self.kv.truncate(r, start + min(step.kv_valid[i], appended))
            if self.spec_config is not None and step.mode is not ForwardMode.EXTEND and r.spec:
                drafted = sum(1 for f in r.spec.forced if not f) if step.drafts else 0
                r.spec.record(drafted, step.accepted[i] if step.drafts else 0)
            if failed[i] is None and not r.finished and r.grammar is not None:
                # Forced tokens have no distribution of their own: no fast-forward for
                # requests that asked for logprobs.
                if self.fast_forward and rows_left > 0 and not r.return_logprob:
                    forced, failed[i] = self._fast_forward(r, rows_left)
                    rows_left -= len(forced)
                    spec_rows -= len(forced)
                    forced_rows += [i] * len(forced)
                    forced_ids += forced
            if failed[i] is None and not r.finished and self.spec_config is not None:
                drafters.append(r)
            elif r.spec is not None:
                r.spec.clear_draft()
            if failed[i] is not None:
                message, status = failed[i]
                logger.warning("%s aborting %s: %s", self.rank_info.log_prefix, r.rid, message)
                r.finished_reason = FinishReason("abort", message=message, status_code=status)
            if r.finished:
                self._release_finished(r)
        if drafters:
            self._draft_all(drafters, min(rows_left, spec_rows), batch + len(forced_ids))
        info.cumulate_forced_tokens(forced_rows, forced_ids)
        if forced_rows:
            self.batch_log.record_forced(forced_rows, forced_ids)

    def _append_tokens(self, req: Req, tokens: list[int]) -> tuple[int, Optional[tuple[str, int]]]:
        """Append a step's tokens (one, or drafts kept plus one) until the request
        finishes; (tokens appended, failure or None)."""
        for n, tok in enumerate(tokens, 1):
            req.output_ids.append(tok)
            message = accept_into_grammar(req, tok)
            if message is not None:
                return n, (message, 500)
            req.check_finished(self.tokenizer)
            if req.finished:
                return n, None
        return len(tokens), None

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
        self.step_stats.fast_forward_tokens += len(appended)
        return appended, None

    def _release_finished(self, req: Req) -> None:
        """A finished request: its grammar is done, its KV released, and it is forgotten."""
        if req.grammar is not None:
            req.grammar.finished = True
        self.kv.release(req)
        self.reqs.pop(req.rid, None)

    def _update_running(self, step: BatchStep) -> None:
        """A prefill's unfinished requests join ``running`` (their prompts' KV is shared from
        now on, not only after they finish); a decode's finished ones leave it. The
        sampling state follows, row for row."""
        reqs = step.reqs
        keep = [i for i, r in enumerate(reqs) if not r.finished]
        if step.mode is ForwardMode.EXTEND:
            for i in keep:
                self.kv.cache_prefilled(reqs[i])
        if step.mode is ForwardMode.DECODE:
            self._keep_running([r for r in self.running if not r.finished])
            return
        if not keep:
            return
        if len(keep) < len(reqs):
            step.info.filter_batch(keep)
        self.running.extend(reqs[i] for i in keep)
        if self.running_info is None:
            self.running_info = step.info
        else:
            self.running_info.merge_batch(step.info)


def accept_into_grammar(req: Req, token: int) -> Optional[str]:
    """Advance the request's grammar; an error message if it rejects the token."""
    if req.grammar is None:
        return None
    try:
        req.grammar.accept_token(token)
    except Exception as e:  # aborts this request only
        return f"Grammar rejected the sampled token {token}: {e}"
    return None
