"""Which DP group (an independent TP group) serves a new request.

The frontend is the only place that sees every request, so it keeps the per-group count
of requests in flight itself; no message from the schedulers is needed.
"""
from __future__ import annotations


class DPDispatcher:
    METHODS = ("round_robin", "shortest_queue")

    def __init__(self, dp_size: int, method: str = "round_robin"):
        if method not in self.METHODS:
            raise ValueError(f"Unknown load balance method {method!r}; use one of {self.METHODS}")
        self.method = method
        self.in_flight = [0] * dp_size
        self._next = 0

    def pick(self) -> int:
        """The group for the next request; counts it as in flight there."""
        if self.method == "round_robin":
            dp = self._next
            self._next = (self._next + 1) % len(self.in_flight)
        else:  # fewest in flight; ties go to the lowest group
            dp = min(range(len(self.in_flight)), key=self.in_flight.__getitem__)
        self.in_flight[dp] += 1
        return dp

    def done(self, dp: int) -> None:
        self.in_flight[dp] -= 1
