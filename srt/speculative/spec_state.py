"""One request's speculation: its n-gram index, the draft the next step verifies, and the
acceptance history that sizes the next draft.

Sizing: a request's per-token acceptance rate r (kept per match-length bucket) says what
its next draft is worth, r^d expected tokens from its d-th token; the step's plan
(draft_plan.py) weighs every request's worth against what the extra rows cost
(step_cost.py), so a request whose drafts keep failing stops drafting, and a step whose
extra rows cost more than they return drafts nothing. A request that stopped drafting
probes again after ``probe_every`` idle steps with a short draft (the wait doubles per
probe), so a copy that starts later (the JSON after a preamble) is still found.

Every input is agreed across ranks (accepted counts, batch rows; a single rank's own step
times only where it is alone), so every rank sizes the same drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from srt.speculative.draft_plan import DraftAsk, plan_draft_lengths
from srt.speculative.ngram import NgramIndex

PRIOR_RATE = 0.6  # acceptance rate assumed before a request's first verification
EMA = 0.3  # weight of the newest verification in the acceptance estimate
PROBE_EVERY = 16  # steps between probes of a request that stopped drafting
PROBE_TOKENS = 2
MAX_PROBE_EVERY = 256
# Acceptance is estimated per length of the suffix match a draft came from (1, 2, 3+
# tokens): a one-token match on a common token is a guess, a long one is a copy.
MATCH_BUCKETS = 3


@dataclass(frozen=True)
class SpecConfig:
    """The speculation settings of a scheduler (from ServerArgs)."""

    num_draft_tokens: int  # most drafted tokens per request per step
    min_match: int  # shortest suffix that counts as a match (n-gram window)
    max_match: int  # longest suffix tried
    row_cost: float  # one extra decode row's cost, relative to a one-row step (flat model)
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
    probe_every: int = PROBE_EVERY  # idle steps before a probe (doubles per probe)
    probing: bool = False  # its current ask is a probe

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

    def ask(self, limit: int, match: int, remaining: int = 0) -> DraftAsk:
        """What this request asks of the step's plan (draft_plan.py): its acceptance rate
        for a draft from a suffix match of ``match`` tokens (> 0; sets the draft's bucket)
        and at most ``limit`` tokens; ``remaining``: tokens it may still generate. A request
        idle for ``probe_every`` steps asks for a short probe at the prior rate, so a copy
        that starts later is still found."""
        self.bucket = min(match, MATCH_BUCKETS) - 1
        rate = self.rates[self.bucket]
        self.probing = self.idle_steps >= self.probe_every
        if self.probing:
            return DraftAsk(max(rate, PRIOR_RATE), min(PROBE_TOKENS, limit), remaining)
        return DraftAsk(rate, limit, remaining)

    def planned(self, length: int) -> None:
        """The plan gave it ``length`` tokens. A probe doubles the wait before the next one
        (failing probes cost a slower step each; a success drafts on its own rate and
        resets the wait)."""
        if length == 0:
            self.idle_steps += 1
            return
        self.idle_steps = 0
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY) if self.probing else PROBE_EVERY


def best_draft_length(rate: float, limit: int, row_cost: float) -> int:
    """One request alone under the flat cost model (``row_cost`` per extra row)."""
    return plan_draft_lengths([DraftAsk(rate, limit)], 1, limit, lambda rows: 1.0 + row_cost * (rows - 1))[0]


def auto_off_reason(args, device: str, int4_codes: bool, dtype: torch.dtype) -> Optional[str]:
    """Why ``--speculative-algorithm auto`` leaves speculation off here (None: it is on);
    ``dtype`` is the model's."""
    if int4_codes:
        return ("the GGUF's 4-bit codes are served (bf16 activations, and the dense weights above the rows "
                "the codes serve), where a verify step's rows can round differently from a plain step's")
    if dtype != torch.float32:  # bench_spec, 2026-12-04: chat bs=1 differed at token 36
        return (f"the model runs in {str(dtype).removeprefix('torch.')}, where a verify step's rows "
                "round differently from a plain step's, so greedy outputs could change")
    if args.pp_size > 1:
        return "--pp-size > 1 (not built)"
    if not device.startswith("cpu"):
        return "not measured on CUDA yet"
    return None


def spec_config_from_args(args, device: str, int4_codes: bool, dtype: torch.dtype) -> Optional[SpecConfig]:
    """The scheduler's settings, or None with speculation off. ``auto`` (the default) is
    NGRAM where it is exact and measured: CPU, one pipeline stage, an fp32 model (``dtype``)
    and weights whose verify rows compute what a plain step computes (not a GGUF's 4-bit
    codes, ``int4_codes``)."""
    from srt import environ

    algorithm = args.speculative_algorithm
    if algorithm == "auto":
        algorithm = None if auto_off_reason(args, device, int4_codes, dtype) else "NGRAM"
    if algorithm in (None, "none"):
        return None
    return SpecConfig(num_draft_tokens=args.speculative_num_draft_tokens,
                      min_match=args.speculative_ngram_min_match_window_size,
                      max_match=args.speculative_ngram_max_match_window_size,
                      row_cost=environ.GRAMSYNC_SPEC_ROW_COST.get(),
                      max_rows=environ.GRAMSYNC_SPEC_MAX_ROWS.get())
