"""What a decode step of n rows costs, as the draft planner sees it.

A flat "one more row costs c of a one-row step" holds for a memory-bound dense step, not
for the steps gramsync actually runs: a 4-bit GGUF's batch-1 graph reads the file's codes
and a 2-row step the dequantized weights (1.7x the time on an AVX2 machine), the compiled
graphs change at 2 and 17 rows, and a compute-bound step grows with every row. So a
single-rank scheduler measures its own decode steps (wall time of the whole scheduler step,
drafting and sampling included: what the user waits for) and the planner reads the median
of the last few at each row count; a row count not measured yet is estimated from the
measured ones (interpolated between two, the flat model scaled from the nearest outside).

Ranks must size the same drafts, and their clocks differ: with more than one rank in the
agreement group (TP, PP) nothing is measured and the flat model alone is used.
"""
from __future__ import annotations

import bisect
import collections
import statistics

WINDOW = 8  # steps kept per row count (median: one slow step, a GC pause, moves nothing)
# A row count not measured in this many steps is forgotten: a step's cost also depends on
# its requests (context lengths, grammars), so an old figure misleads; the planner then
# estimates it from the fresh ones, drafts, and so measures it again.
MAX_AGE = 256


class StepCostTable:
    def __init__(self, row_cost: float, measure: bool):
        self.row_cost = row_cost
        self.measure = measure
        self._seconds: dict[int, collections.deque] = {}
        self._rows: list[int] = []  # measured row counts, sorted
        self._last: dict[int, int] = {}  # row count -> the step that last measured it
        self._steps = 0

    def flat(self, rows: int) -> float:
        """The flat model: a one-row step costs 1."""
        return 1.0 + self.row_cost * (rows - 1)

    def observe(self, rows: int, seconds: float) -> None:
        if not self.measure or rows <= 0:
            return
        if rows not in self._seconds:
            self._seconds[rows] = collections.deque(maxlen=WINDOW)
            bisect.insort(self._rows, rows)
        self._seconds[rows].append(seconds)
        self._steps += 1
        self._last[rows] = self._steps
        for old in [r for r in self._rows if self._last[r] < self._steps - MAX_AGE]:
            del self._seconds[old], self._last[old]
            self._rows.remove(old)

    def reset(self) -> None:
        """The step changed (the compiled graphs took over): measure again."""
        self._seconds.clear()
        self._rows.clear()
        self._last.clear()

    def cost(self, rows: int) -> float:
        """Seconds (measured, or estimated from measured ones), else the flat model's units.
        Never below a measured smaller step plus the flat model's rows in between: medians
        taken at different times can put 6 rows below 4 on a noisy machine, and a planner
        that believes rows are free drafts on any odds."""
        known = self._rows
        if not known:
            return self.flat(rows)
        i = bisect.bisect_left(known, rows)
        if rows in self._seconds:
            est = self._median(rows)
        elif 0 < i < len(known):
            lo, hi = known[i - 1], known[i]
            t_lo, t_hi = self._median(lo), self._median(hi)
            est = t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        else:
            near = known[0] if i == 0 else known[-1]
            est = self._median(near) * self.flat(rows) / self.flat(near)
        floor = max((self._median(m) * self.flat(rows) / self.flat(m) for m in known[:i]), default=0.0)
        return max(est, floor)

    def _median(self, rows: int) -> float:
        return statistics.median(self._seconds[rows])
