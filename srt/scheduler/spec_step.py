"""The scheduler's speculative-decoding phases (``--speculative-algorithm NGRAM``).

After a request's tokens are accepted, it may draft the tokens it expects next
(``_draft``: n-gram over its own tokens, cut by its grammar); the next decode step feeds
them as extra rows after its uncomputed tokens, so one forward computes the logits of
every drafted position. ``_sample_drafts`` then samples each position with the full
pipeline (sampling/verify_batch.py), the TP group agrees on those samples, and each
request keeps its samples while they equal its drafts, plus the first that differs.
``BatchStepMixin._process_results`` appends them one by one (stop conditions, grammar,
max_new_tokens hold inside the run) and frees the KV of the positions not kept.

Every rank drafts, samples and accepts the same tokens: drafts are pure functions of
tokens and grammar state, and the samples go through the token agreement collective.
"""
from __future__ import annotations

from typing import Optional

import torch

from sampling.logprobs import chosen_and_top
from sampling.verify_batch import expand_for_verify, verify_rows
from srt.scheduler.req import Req
from srt.speculative.drafter import make_draft
from srt.speculative.draft_plan import plan_draft_lengths
from srt.speculative.spec_state import SpecState


class SpecStepMixin:
    """Uses the scheduler's spec_config (None: off), step_cost, step_cost_compiled, waiting,
    running, grammar_manager, fast_forward, running_info, runner, tp, rank_info, step_stats,
    batch_log and vocab_size."""

    def _draft_all(self, reqs: list[Req], max_extra: int, base_rows: int) -> None:
        """Draft the next tokens of ``reqs`` for the coming decode step: one plan for the
        step (draft_plan.py) over at most ``max_extra`` rows beyond its ``base_rows``."""
        cfg = self.spec_config
        asks, askers = [], []
        for req in reqs:
            if req.spec is None:
                req.spec = SpecState()
            spec = req.spec
            spec.clear_draft()
            limit = min(cfg.num_draft_tokens, max_extra, req.remaining_new_tokens() - 1)
            if limit <= 0:
                continue
            spec.index.sync(req.fill_ids)
            match, _ = spec.index.best_match(cfg.min_match, cfg.max_match)
            if match == 0:
                continue  # nothing to copy from (forced tokens alone are fast-forward's)
            if req.grammar is None:  # no row planned beyond what the n-gram has to offer
                limit = len(spec.index.propose(limit, cfg.min_match, cfg.max_match))
            if limit > 0:
                asks.append(spec.ask(limit, match, req.remaining_new_tokens()))
                askers.append(req)
        if not asks:
            return
        tail = self._closed_tail(reqs, askers)
        lengths = plan_draft_lengths(asks, base_rows, max_extra, self.step_cost.cost, tail)
        for req, length in zip(askers, lengths):
            req.spec.planned(length)
            if length == 0:
                continue
            # Forced tokens are taken as fast-forward takes them, where a plain step would.
            force = self.fast_forward and not req.return_logprob
            draft = make_draft(req, length, cfg, self.vocab_size, force)
            spec = req.spec
            spec.draft, spec.forced, spec.masks, spec.bonus = (draft.tokens, draft.forced,
                                                              draft.masks, draft.bonus)
            self.step_stats.spec_drafted_tokens += len(draft.tokens)

    def _closed_tail(self, reqs: list[Req], askers: list[Req]) -> Optional[int]:
        """None while requests wait to be admitted (the step's throughput is what counts);
        else the most tokens a request of the batch (``reqs``: this step's) that does not
        draft may still generate. Waiting and running lists are identical on every rank."""
        if self.waiting or self.grammar_manager.grammar_queue:
            return None
        asking = {id(r) for r in askers}
        return max((r.remaining_new_tokens() for r in self.running + reqs
                    if id(r) not in asking and not r.finished), default=0)

    def _observe_decode_cost(self, rows: int, seconds: float) -> None:
        """A decode step's wall time, for the plan; measured again from the step in which
        the compiled graphs take over from the eager ones."""
        decode = self.runner.compiled_switch.decode
        compiled = decode is not None and decode.ready
        if compiled != self.step_cost_compiled:
            self.step_cost.reset()
            self.step_cost_compiled = compiled
        self.step_cost.observe(rows, seconds)

    def _sample_drafts(self, step) -> None:
        """Sample every verified position of the step; set ``step.tokens`` (per request:
        the drafts kept, then one sampled token), ``step.accepted`` (n-gram drafts kept)
        and ``step.kv_valid`` (leading tokens of the run whose KV the step computed)."""
        reqs, info, drafts = step.reqs, self.running_info, step.drafts
        info.update_regex_vocab_mask()  # row 0 of each request; dead ends counted on info
        vinfo = expand_for_verify(info, drafts, [r.spec.masks if r.spec else None for r in reqs])
        src, offsets = verify_rows(drafts)
        entry = self.rank_info.is_entry_rank
        lp_rows = [k for k, i in enumerate(src) if reqs[i].return_logprob] if entry else []
        ids, logprobs = self.runner.sample(step.logits, vinfo, lp_rows)
        step.has_grammar = any(g is not None for g in info.grammars)
        if not self.tp.is_single:  # the accepted lengths shape every rank's next batch
            ids = self._agree_on_tokens(ids)
        self.step_stats.count_mask(vinfo)
        info.failed_rows += [(src[row], m, code) for row, (m, code) in vinfo.take_failed_rows().items()]
        samples = ids.tolist()
        tokens, accepted, kv_valid, row = [], [], [], 0
        for r, d in zip(reqs, drafts):
            forced = r.spec.forced if d else []
            j = 0  # a forced token is taken without looking at the sample
            while j < len(d) and (forced[j] or samples[row + j] == d[j]):
                j += 1
            if j == len(d) and d and not r.spec.bonus:  # what follows is forced: no sample,
                tokens.append(list(d))  # and the last token is fed again next step
                kv_valid.append(j - 1)
            else:
                tokens.append(list(d[:j]) + [samples[row + j]])
                kv_valid.append(j)
            accepted.append(sum(1 for f in forced[:j] if not f))
            row += len(d) + 1
        if lp_rows:
            _record_logprobs(reqs, src, offsets, lp_rows, logprobs, ids, tokens)
        info.cumulate_forced_tokens([i for i, t in enumerate(tokens) for _ in t],
                                    [x for t in tokens for x in t])
        step.info, step.tokens, step.accepted, step.kv_valid = info, tokens, accepted, kv_valid
        self.batch_log.record_verified(tokens)
        self.step_stats.spec_verify_steps += 1
        self.step_stats.spec_accepted_tokens += sum(accepted)


def _record_logprobs(reqs: list[Req], src: list[int], offsets: list[int], lp_rows: list[int],
                     logprobs: torch.Tensor, ids: torch.Tensor, tokens: list[list[int]]) -> None:
    """Each kept token's logprob, from the row that sampled it (rows past a request's
    first mismatch are dropped)."""
    keep = [k for k, row in enumerate(lp_rows) if offsets[row] < len(tokens[src[row]])]
    if not keep:
        return
    rows = [lp_rows[k] for k in keep]
    picked = chosen_and_top(logprobs[torch.tensor(keep, dtype=torch.int64)],
                            ids[torch.tensor(rows, dtype=torch.int64, device=ids.device)],
                            [reqs[src[row]].logprobs.top_n for row in rows])
    for row, (lp, top) in zip(rows, picked):
        r = reqs[src[row]]
        r.output_token_logprobs.append(lp)
        r.output_top_logprobs.append(top)
