"""One request's speculation: its n-gram index, the draft the next step verifies, and the
acceptance history that sizes the next draft.

Sizing (item "never slower"): a step that verifies d drafted tokens of a request costs
about ``1 + c_eff * d`` plain steps, where ``c_eff`` is one extra row's cost relative to
this request's share of the step; with a per-token acceptance rate r, the request gains
``(1 - r^(d+1)) / (1 - r)`` tokens (r is kept per match-length bucket). The draft length
maximises gain over cost, so it falls to 0 (no drafting) once r drops below ``c_eff``: a
request whose drafts keep failing stops drafting, and a large batch (where rows are no
longer free) drafts only near-certain copies. A request that stopped drafting probes again every ``PROBE_EVERY`` steps with a
short draft, so a copy that starts later (the JSON after a preamble) is still found.

Every input is agreed across ranks (accepted counts, batch size), so every rank sizes the
same drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from srt.speculative.ngram import NgramIndex

PRIOR_RATE = 0.6  # acceptance rate assumed before a request's first verification
EMA = 0.3  # weight of the newest verification in the acceptance estimate
PROBE_EVERY = 16  # steps between probes of a request that stopped drafting
PROBE_TOKENS = 2
# Acceptance is estimated per length of the suffix match a draft came from (1, 2, 3+
# tokens): a one-token match on a common token is a guess, a long one is a copy.
MATCH_BUCKETS = 3


@dataclass(frozen=True)
class SpecConfig:
    """The speculation settings of a scheduler (from ServerArgs)."""

    num_draft_tokens: int  # most drafted tokens per request per step
    min_match: int  # shortest suffix that counts as a match (n-gram window)
    max_match: int  # longest suffix tried
    row_cost: float  # one extra decode row's cost, relative to a one-row step
    max_rows: int  # no drafting once the decode batch has this many rows


@dataclass
class SpecState:
    index: NgramIndex = field(default_factory=NgramIndex)
    draft: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)  # per drafted token: grammar-forced
    # Grammar bitmask rows of the drafted positions 1..d (row j: after draft[:j]); row 0
    # is the running batch's own mask row. None: no grammar.
    masks: Optional[torch.Tensor] = None
    bonus: bool = True  # the position after the draft is sampled (not grammar-forced)
    # Estimated per-token acceptance, per match-length bucket; the current draft's bucket.
    rates: list[float] = field(default_factory=lambda: [PRIOR_RATE] * MATCH_BUCKETS)
    bucket: int = 0
    verify_ct: int = 0  # decode steps of this request while speculation was on
    idle_steps: int = 0  # steps since it last drafted

    def clear_draft(self) -> None:
        self.draft, self.forced, self.masks, self.bonus = [], [], None, True

    def record(self, drafted: int, accepted: int) -> None:
        """One verification: ``accepted`` of ``drafted`` tokens matched the samples."""
        self.verify_ct += 1
        if drafted == 0:
            return
        # A rejection at position j says the first j were accepted and the next was not;
        # full acceptance says nothing about the token after the last draft.
        trials = accepted + (1 if accepted < drafted else 0)
        b = self.bucket
        self.rates[b] = (1 - EMA) * self.rates[b] + EMA * (accepted / trials)

    def draft_length(self, limit: int, row_cost: float, match: int) -> int:
        """How many tokens to draft next (0: none), at most ``limit``, from a suffix match
        of ``match`` tokens (> 0); sets the draft's bucket."""
        self.bucket = min(match, MATCH_BUCKETS) - 1
        best = best_draft_length(self.rates[self.bucket], limit, row_cost)
        if best > 0:
            self.idle_steps = 0
            return best
        self.idle_steps += 1
        if self.idle_steps >= PROBE_EVERY:
            self.idle_steps = 0
            return min(PROBE_TOKENS, limit)
        return 0


def best_draft_length(rate: float, limit: int, row_cost: float) -> int:
    """argmax over d in [0, limit] of expected tokens per step cost (see the module doc)."""
    best, best_value = 0, 1.0
    gain, p = 1.0, 1.0
    for d in range(1, limit + 1):
        p *= rate
        gain += p
        value = gain / (1.0 + row_cost * d)
        if value > best_value + 1e-9:
            best, best_value = d, value
    return best


def effective_row_cost(row_cost: float, batch_size: int) -> float:
    """One extra row's cost relative to one request's share of a ``batch_size``-row step."""
    return row_cost * batch_size / (1.0 + row_cost * (batch_size - 1))


def spec_config_from_args(args, device: str) -> Optional[SpecConfig]:
    """The scheduler's settings, or None with speculation off."""
    from srt import environ

    if args.speculative_algorithm is None:
        return None
    return SpecConfig(num_draft_tokens=args.speculative_num_draft_tokens,
                      min_match=args.speculative_ngram_min_match_window_size,
                      max_match=args.speculative_ngram_max_match_window_size,
                      row_cost=environ.GRAMSYNC_SPEC_ROW_COST.get(),
                      max_rows=environ.GRAMSYNC_SPEC_MAX_ROWS.get())
