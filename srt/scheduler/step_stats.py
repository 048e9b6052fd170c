"""Where a scheduler iteration's time goes, accumulated per batch kind, and the scheduler's
cumulative counters (cheap: a handful of calls per step, never per token or layer).

``bench_offline.py`` prints the phase times as the per-step breakdown. One step reads
``start_step()``, then ``with phase("forward"): ...`` around each timed phase, then
``end_step(mode)``: that commits the step's phases to its mode and charges whatever they
did not take (batching, bookkeeping, outputs) to "scheduler". A step that ran no batch
never reaches ``end_step`` and counts nowhere.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("forward", "sampling", "grammar", "scheduler")


@dataclass
class PhaseTimes:
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {k: 1e3 * v / n for k, v in self.seconds.items()}


class PhaseTimer:
    """``with stats.phase(name):`` adds the block's seconds to the current step's phase."""
    __slots__ = ("_step", "_name", "_counted", "_start")

    def __init__(self, step: dict[str, float], name: str, counted: bool):
        self._step, self._name, self._counted = step, name, counted

    def __enter__(self) -> PhaseTimer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._counted:
            self._step[self._name] = self._step.get(self._name, 0.0) + time.perf_counter() - self._start

    def cancel(self) -> None:
        """Leave this block uncounted: its seconds fall to "scheduler"."""
        self._counted = False


@dataclass
class StepStats:
    """One ``PhaseTimes`` per forward mode name (``DECODE``, ``EXTEND``), and counters."""
    by_mode: dict[str, PhaseTimes] = field(default_factory=dict)
    # Grammar masks: the fill as waited for on the critical path and as worked (overlapped
    # or not), the apply, and how many steps had a mask.
    mask_fill_seconds: float = 0.0
    mask_fill_work_seconds: float = 0.0
    mask_apply_seconds: float = 0.0
    mask_steps: int = 0
    mask_checked_first_steps: int = 0  # steps whose argmax every grammar allowed: no mask
    # Token agreement (TP > 1, batches with grammars): rows where this rank's own sample
    # differed from the agreed one. Expected to stay 0; measured, not assumed.
    token_agreement_steps: int = 0
    token_mismatches: int = 0
    fast_forward_tokens: int = 0  # output tokens grammar fast-forward appended
    # Speculative decoding: steps that verified drafts, tokens drafted, drafts accepted.
    spec_verify_steps: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    _step: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _step_start: float = field(default=0.0, init=False, repr=False)

    def mode(self, name: str) -> PhaseTimes:
        return self.by_mode.setdefault(name, PhaseTimes())

    def reset(self) -> None:
        """The phase times only: the counters keep counting."""
        self.by_mode.clear()

    # ---- one step ----------------------------------------------------------------------
    def start_step(self) -> None:
        self._step = {}
        self._step_start = time.perf_counter()

    def phase(self, name: str, counted: bool = True) -> PhaseTimer:
        """Time a block as ``name``; ``counted=False`` leaves it to "scheduler"."""
        return PhaseTimer(self._step, name, counted)

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-attribute seconds a ``src`` block spent on ``dst`` work."""
        self._step[src] = self._step.get(src, 0.0) - seconds
        self._step[dst] = self._step.get(dst, 0.0) + seconds

    def end_step(self, mode_name: str) -> None:
        now = time.perf_counter()
        times = self.mode(mode_name)
        times.steps += 1
        for phase, seconds in self._step.items():
            times.add(phase, seconds)
        times.add("scheduler", now - self._step_start - sum(self._step.values()))

    def step_seconds(self) -> float:
        """Since ``start_step``."""
        return time.perf_counter() - self._step_start

    # ---- counters ----------------------------------------------------------------------
    def count_mask(self, info) -> None:
        """A sampled batch (``SamplingBatchInfo``): its grammar mask's seconds, if it had one."""
        if info.vocab_mask is not None:
            self.mask_fill_seconds += info.mask_fill_seconds
            self.mask_fill_work_seconds += info.mask_fill_work_seconds
            self.mask_apply_seconds += info.mask_apply_seconds
            self.mask_steps += 1
        elif info.mask_checked_first:
            self.mask_checked_first_steps += 1

    def count_agreement(self, mismatches: int) -> None:
        self.token_agreement_steps += 1
        self.token_mismatches += mismatches

