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


class StepCostTable:
    def __init__(self, row_cost: float, measure: bool):
        self.row_cost = row_cost
        self.measure = measure
        self._seconds: dict[int, collections.deque] = {}
        self._rows: list[int] = []  # measured row counts, sorted

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

    def reset(self) -> None:
        """The step changed (the compiled graphs took over): measure again."""
        self._seconds.clear()
        self._rows.clear()

    def cost(self, rows: int) -> float:
        """Seconds (measured, or estimated from measured ones), else the flat model's units."""
        known = self._rows
        if not known:
            return self.flat(rows)
        if rows in self._seconds:
            return self._median(rows)
        i = bisect.bisect_left(known, rows)
        if 0 < i < len(known):
            lo, hi = known[i - 1], known[i]
            t_lo, t_hi = self._median(lo), self._median(hi)
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        near = known[0] if i == 0 else known[-1]
        return self._median(near) * self.flat(rows) / self.flat(near)

    def _median(self, rows: int) -> float:
        return statistics.median(self._seconds[rows])
