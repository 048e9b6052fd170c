"""Which waiting requests join the next prefill batch (FCFS under the budgets)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from srt.scheduler.req import Req


class PrefillAdder:
    """Admits requests in arrival order while they fit.

    KV budget: every admitted request reserves its prompt plus its remaining new tokens
    (capped at ``clip_new_tokens``, as SGLang's estimate), on top of what running requests
    still reserve, so decoding rarely runs out; if it does, the scheduler retracts.
    """

    def __init__(self, running: list[Req], available_tokens: int, max_running: int,
                 max_prefill_tokens: int, clip_new_tokens: int, chunk_size: Optional[int] = None,
                 share_prompts: bool = False, share_scores: bool = False):
        self.available = available_tokens
        self.slots = max_running - len(running)
        self.max_prefill_tokens = max_prefill_tokens
        # None: no chunking. Chunks bound how long running requests wait for their next
        # token; with none running they protect nobody, so a step may take a whole prefill
        # budget (prompt scoring: 4x fewer, larger steps, docs/speed.md "Chunked prefill").
        if chunk_size is not None and not running:
            chunk_size = max(chunk_size, max_prefill_tokens)
        self.chunk_size = chunk_size
        self.clip = clip_new_tokens
        self.reserved = sum(max(min(r.remaining_new_tokens(), clip_new_tokens), r.decode_rows)
                            for r in running)  # drafts take slots in the coming step
        self.busy = bool(running)
        self.share_prompts = share_prompts
        self.share_scores = share_scores

    def select(self, waiting: deque[Req], lock_prefix: Callable[[Req], int] = lambda r: 0,
               unlock_prefix: Callable[[Req], None] = lambda r: None) -> list[Req]:
        """``lock_prefix(req)`` takes the request's cached prefix (radix cache) and returns
        the tokens that stopped being evictable, which leaves the budget; ``unlock_prefix``
        undoes it for the request that did not fit."""
        picked: list[Req] = []
        extend_tokens = 0
        for req in waiting:
            if len(picked) >= self.slots:
                break
            newly_locked = lock_prefix(req)
            self.available -= newly_locked
            extend = req.seqlen - _computed_len(req)
            if self.shares_prompt_with(picked, req, extend):
                unlock_prefix(req)  # next step it finds the prompt in the radix cache
                self.available += newly_locked
                if not req.output_ids:
                    req.cached_tokens = None  # not admitted: measured again next step
                break
            # This step's share: all of it, or what is left of the chunk budget.
            step = extend if self.chunk_size is None else min(extend, self.chunk_size - extend_tokens)
            # The whole rest is reserved even when chunked, as it would be unchunked.
            need = extend + min(req.remaining_new_tokens(), self.clip)
            too_many = step <= 0 or (picked and extend_tokens + step > self.max_prefill_tokens)
            if self.busy or picked:
                no_room = self.reserved + need > self.available
            else:
                no_room = extend + 1 > self.available
            if too_many or no_room:
                unlock_prefix(req)
                self.available += newly_locked
                break
            picked.append(req)
            self.reserved += need
            extend_tokens += step
            req.extend_limit = step if step < extend else None
            if req.extend_limit is not None:
                break  # a chunked request is always the batch's last
        return picked

    def shares_prompt_with(self, picked: list[Req], req: Req, extend: int) -> bool:
        """Does this batch already prefill what ``req`` would compute? Then it waits one
        step and takes it from the radix cache (only with the cache: ``share_prompts``):
        - another sample (``n`` > 1) of a prompt this batch prefills;
        - with prompt logprobs (``share_scores``: they are cached too), a request whose
          next ``SHARED_SCORE_MIN`` tokens another scores here, with as many alternatives
          (lm-eval's choices of one question, sent together)."""
        if not self.share_prompts or extend <= 1:
            return False
        if req.input_logprobs_done:
            return req.prefix_group is not None and any(p.prefix_group == req.prefix_group for p in picked)
        return self.share_scores and any(_scores_ahead_of(p, req) for p in picked)


# Shared tokens past the cached prefix that make a scoring request wait for another's
# (SGLang's in-batch prefix threshold): fewer cost less to compute than a step's wait.
SHARED_SCORE_MIN = 32


def _scores_ahead_of(p: Req, req: Req) -> bool:
    """Will ``p``'s prefill score the next ``SHARED_SCORE_MIN`` tokens of ``req``?"""
    if p.input_logprobs_done or p.logprobs.top_n < req.logprobs.top_n:
        return False
    start = _computed_len(req)
    end = start + SHARED_SCORE_MIN
    ids = req.fill_ids
    return p.logprob_start <= max(start, 1) and len(ids) > end and p.fill_ids[:end] == ids[:end]


def _computed_len(req: Req) -> int:
    """Tokens whose KV exists or comes from the cache: not prefilled again."""
    if req.req_pool_idx is not None:
        return req.kv_committed_len
    return len(req.prefix_slots) if req.prefix_slots is not None else 0
