"""Prompt logprobs served from the radix cache (scoring at cache speed).

A request asking for prompt logprobs from position L used to reuse cached KV only up to
L - 1: every position from L on had to be run again for its logits. With the pool of
``srt/mem_cache/prompt_logprob_pool.py`` the tree's slots also carry the logprobs scoring
reported for them, so such a request takes the cached positions' logprobs as they are
and prefills only the rest (plus ``RECOMPUTE_ROWS``, below).

The positions used are decided from ``top_count`` alone, identical on every rank, so
every rank locks the same prefix; only the rank that holds the numbers reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from srt.mem_cache.prompt_logprob_pool import PromptLogprobPool
from srt.mem_cache.radix_cache import RadixCache
from srt.scheduler.req import Req

# Where the cache covers only part of what a request scores, this many positions before
# the first uncovered one are run again with it. A CPU forward over a handful of rows
# takes other GEMM kernels than a whole prompt's (oneDNN's small-M paths), whose last bits
# differ; with 16 rows or more they came out bit-identical to a whole prompt's in most
# cases measured (fp32, eager; never guaranteed: docs/evaluation.md "Scoring at cache
# speed"), at the cost of 16 tokens next to a long shared context.
RECOMPUTE_ROWS = 16


@dataclass
class CachedPromptLogprobs:
    """What a match found, kept on the request until it is admitted (or unlocked)."""

    until: int  # prompt tokens [first, until) are served from the cache
    entries: list  # (logprob, top) per token, on the rank that holds values; else []


def first_scored(req: Req) -> int:
    """The first prompt position with a logprob (position 0 has none: it is None)."""
    return max(req.logprob_start, 1)


def match_for_scoring(req: Req, tree: RadixCache, pool: PromptLogprobPool) -> int:
    """How many leading tokens of a request with pending prompt logprobs take their KV
    from the cache; positions whose logprobs the cache holds (with at least the
    request's number of alternatives) come from it (stashed on the request)."""
    first, top_n, ids = first_scored(req), req.logprobs.top_n, req.fill_ids
    slots = tree.peek(ids)
    matched = len(slots)
    covered = matched  # positions [first, covered) have cached logprobs
    if matched > first:
        short = (pool.counts(slots[first:]) < top_n).nonzero()
        if len(short):
            covered = first + int(short[0])
    if covered == len(ids):  # all of it (the same prompt again, n > 1): only the last
        prefix = len(ids) - 1  # token is computed, for the request's logits
    else:
        prefix = min(matched, max(covered - RECOMPUTE_ROWS, first - 1))
    req.cached_prompt_logprobs = None
    if prefix >= first:  # tokens first..prefix; the forward starts at ``prefix``
        entries = pool.read(slots[first:prefix + 1], top_n) if pool.holds_values else []
        req.cached_prompt_logprobs = CachedPromptLogprobs(prefix + 1, entries)
    return prefix


def take_cached(req: Req) -> None:
    """At admission: the stashed cached logprobs become the request's first ones."""
    cached = req.cached_prompt_logprobs
    if cached is None:
        return
    req.cached_prompt_logprobs = None
    if cached.entries:
        if req.logprob_start == 0:  # the prompt's first token: no logprob
            req.input_token_logprobs.append(None)
            req.input_top_logprobs.append(())
        for lp, top in cached.entries:
            req.input_token_logprobs.append(lp)
            req.input_top_logprobs.append(top)
    req.scored_until = cached.until


def store_scored(req: Req, tree_slots: torch.Tensor, pool: PromptLogprobPool) -> None:
    """The request's prompt logprobs recorded so far go to the tree's slots of their
    positions (``tree_slots`` covers the tokens just inserted), where those hold fewer
    alternatives; called on every rank alike."""
    if req.logprobs is None:
        return
    lo = max(first_scored(req), req.logprobs_stored_until)
    hi = min(req.scored_until, len(tree_slots))
    if hi <= lo:
        return
    top_n = req.logprobs.top_n
    dst = tree_slots[lo:hi]
    better = (pool.counts(dst) < top_n).nonzero().flatten()
    req.logprobs_stored_until = hi
    if not len(better):
        return
    entries: Optional[list] = None
    if pool.holds_values:
        start = req.logprob_start  # input_token_logprobs[i] is position start + i
        idx = better.tolist()
        entries = [(req.input_token_logprobs[lo + i - start], req.input_top_logprobs[lo + i - start])
                   for i in idx]
    pool.write(dst[better], top_n, entries)
