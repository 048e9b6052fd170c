"""Where a scheduler iteration's time goes, accumulated per batch kind (cheap counters).

``bench_offline.py`` prints these as the per-step breakdown; the scheduler fills them with
``time.perf_counter`` around its phases (a handful of calls per step, never per layer).
"""
from __future__ import annotations

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


@dataclass
class StepStats:
    """One ``PhaseTimes`` per forward mode name (``DECODE``, ``EXTEND``)."""
    by_mode: dict[str, PhaseTimes] = field(default_factory=dict)

    def mode(self, name: str) -> PhaseTimes:
        return self.by_mode.setdefault(name, PhaseTimes())

    def reset(self) -> None:
        self.by_mode.clear()
