"""How many tokens each request of a decode batch drafts: one plan for the whole step.

A request whose drafts are accepted at rate r gains r^d expected tokens from its d-th
drafted token, so for a given number k of extra rows the best allotment takes the k largest
r_i^d over all requests (each request's gains fall with d, so that is a prefix of each
request's draft). The step then yields (base + gains(k)) tokens for cost(base_rows + k);
the plan takes the k with the most tokens per second, and none unless that beats the plain
step by MIN_GAIN: a step whose extra rows cost more than they are likely to return (a
compute-bound step, a batch-1 graph much faster than the next one, drafts that keep
failing) drafts nothing.

A closed batch (nothing waiting to be admitted) ends when its longest request ends: a token
gained by a request that is not the longest only takes a row off the steps after it ends
(the marginal row cost), while the drafted rows slow every step they ride on, so tokens
per second of the step would draft where the batch's end comes later. There the plan also
weighs the time to the batch's end (``closed_plan``, ``expected_end``) and drafts only where
both gain.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

MIN_GAIN = 0.03  # a plan must promise this much more throughput than drafting nothing


@dataclass(frozen=True)
class DraftAsk:
    rate: float  # expected per-token acceptance of this request's next draft
    limit: int  # most tokens it may draft
    remaining: int = 0  # tokens it may still generate (max_new_tokens left): closed batches


def plan_draft_lengths(asks: list[DraftAsk], base_rows: int, max_extra: int,
                       cost: Callable[[int], float], closed_tail: Optional[int] = None) -> list[int]:
    """Per ask, its draft length (0: none). ``base_rows``: the step's rows without drafts
    (each yields a token); ``max_extra``: the most drafted rows the step may add;
    ``closed_tail``: None while requests wait to be admitted, else the most tokens any
    running request that does not ask may still generate (0: none)."""
    if closed_tail is not None:
        return closed_plan(asks, base_rows, max_extra, cost, closed_tail)
    gains = sorted(((-(a.rate ** d), d, i) for i, a in enumerate(asks) for d in range(1, a.limit + 1)))
    order = [i for _, _, i in gains[:max(max_extra, 0)]]
    return _lengths(len(asks), order, _best_k(asks, order, base_rows, cost, None))


def closed_plan(asks: list[DraftAsk], base_rows: int, max_extra: int,
                cost: Callable[[int], float], tail: int) -> list[int]:
    """Rows go to whichever request is furthest from its end, counting the tokens its
    draft so far is expected to gain (ties: the likelier token); each prefix of that order
    is valued by tokens per second and by the time it takes off the batch's end."""
    left = [a.remaining for a in asks]
    depth = [0] * len(asks)
    order = []
    while len(order) < max(max_extra, 0):
        open_ = [i for i, a in enumerate(asks) if depth[i] < a.limit]
        if not open_:
            break
        i = max(open_, key=lambda j: (left[j], asks[j].rate))
        depth[i] += 1
        left[i] -= asks[i].rate ** depth[i]
        order.append(i)
    return _lengths(len(asks), order, _best_k(asks, order, base_rows, cost, tail))


def _best_k(asks, order, base_rows, cost, tail) -> int:
    base_cost = cost(base_rows)
    # One row less for the steps after a shorter request ends; the end itself at one row.
    row = (base_cost - cost(1)) / (base_rows - 1) if base_rows > 1 else cost(2) - cost(1)
    end0 = max([a.remaining for a in asks] + [tail or 0])
    depth = [0] * len(asks)
    best_k, best_value = 0, base_rows / base_cost * (1.0 + MIN_GAIN)
    tokens = float(base_rows)
    for k, i in enumerate(order, 1):
        depth[i] += 1
        tokens += asks[i].rate ** depth[i]
        step_cost = cost(base_rows + k)
        value = tokens / step_cost
        if value <= best_value:
            continue
        if tail is not None:
            sooner = end0 - expected_end(asks, depth, tail)
            saved = row * (tokens - base_rows) + (cost(1) - row) * sooner
            if saved - (step_cost - base_cost) <= MIN_GAIN * base_cost:
                continue
        best_k, best_value = k, value
    return best_k


def expected_end(asks: list[DraftAsk], depth: list[int], tail: int) -> float:
    """E[max over requests of tokens left after this step] (at least ``tail``), each draft
    kept to its j-th token with probability rate^j, independently. Not the max of the
    expected lengths: four requests of one length each drafting a token bring the end one
    nearer only if all four are kept."""
    lo = max([tail] + [a.remaining - d for a, d in zip(asks, depth)])
    hi = max([tail] + [a.remaining for a in asks])
    end = float(lo)
    for t in range(lo, hi):  # P(end > t) = 1 - P(every request ends at t or sooner)
        p_all = 1.0
        for a, d in zip(asks, depth):
            need = a.remaining - t  # tokens it must gain this step
            if need > 0:
                p_all *= a.rate ** need if need <= d else 0.0
        end += 1.0 - p_all
    return end


def _lengths(n: int, order: list[int], k: int) -> list[int]:
    lengths = [0] * n
    for i in order[:k]:
        lengths[i] += 1
    return lengths
