"""How many tokens each request of a decode batch drafts: one plan for the whole step.

A request whose drafts are accepted at rate r gains r^d expected tokens from its d-th
drafted token, so for a given number k of extra rows the best allotment takes the k largest
r_i^d over all requests (each request's gains fall with d, so that is a prefix of each
request's draft). The step then yields (base + gains(k)) tokens for cost(base_rows + k);
the plan takes the k with the most tokens per second, and none unless that beats the plain
step by MIN_GAIN: a step whose extra rows cost more than they are likely to return (a
compute-bound step, a batch-1 graph much faster than the next one, drafts that keep
failing) drafts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MIN_GAIN = 0.03  # a plan must promise this much more throughput than drafting nothing


@dataclass(frozen=True)
class DraftAsk:
    rate: float  # expected per-token acceptance of this request's next draft
    limit: int  # most tokens it may draft


def plan_draft_lengths(asks: list[DraftAsk], base_rows: int, max_extra: int,
                       cost: Callable[[int], float]) -> list[int]:
    """Per ask, its draft length (0: none). ``base_rows``: the step's rows without drafts
    (each yields a token); ``max_extra``: the most drafted rows the step may add."""
    gains = sorted(((-(a.rate ** d), d, i) for i, a in enumerate(asks) for d in range(1, a.limit + 1)))
    gains = gains[:max(max_extra, 0)]
    best_k, best_value = 0, base_rows / cost(base_rows) * (1.0 + MIN_GAIN)
    tokens = float(base_rows)
    for k, (neg_gain, _, _) in enumerate(gains, 1):
        tokens -= neg_gain
        value = tokens / cost(base_rows + k)
        if value > best_value:
            best_k, best_value = k, value
    lengths = [0] * len(asks)
    for _, _, i in gains[:best_k]:
        lengths[i] += 1
    return lengths
