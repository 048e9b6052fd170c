"""Two ways of one step, alternating on one in-process scheduler: the rounds and the report
that bench_prefill_packed.py and bench_extend_as_decode.py share."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def ab_rounds(ways: dict[str, Callable[[], None]], sizes: list[int], step_ms: Callable[[int], float],
              rounds: int, per_round: int) -> dict[tuple[str, int], list[float]]:
    """``ways``: name -> switch the scheduler to it (two of them, the new first). Every size
    is run twice each way first (every graph traced), then per round, in alternating order,
    the median of ``per_round`` steps per way and size. Leaves the first way switched on."""
    names = list(ways)
    for name in names:
        ways[name]()
        for n in sizes:
            step_ms(n), step_ms(n)
    times: dict[tuple[str, int], list[float]] = {(w, n): [] for w in names for n in sizes}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            ways[name]()
            for n in sizes:
                times[(name, n)].append(statistics.median(step_ms(n) for _ in range(per_round)))
    ways[names[0]]()
    return times


def report(times: dict[tuple[str, int], list[float]], what: str) -> None:
    """One line per size: ``<what with n> <new> <ms> ms <old> <ms> ms ratio <x>x (...)``."""
    new, old = dict.fromkeys(w for w, _ in times)
    for n in dict.fromkeys(n for _, n in times):
        a, b = times[(new, n)], times[(old, n)]
        won = sum(x < y for x, y in zip(a, b))
        print(f"{what.format(n=n)}: {new} {statistics.median(a):.1f} ms {old} {statistics.median(b):.1f} ms "
              f"ratio {statistics.median(a) / statistics.median(b):.2f}x ({new} faster in {won} of {len(a)} rounds)")


class PrefillTimer:
    """One request at a time on ``sched``: its prefill step's milliseconds (the request
    generates one token, so the step also samples it), then the request is run out."""

    def __init__(self, sched):
        from sampling.sampling_params import SamplingParams

        self.sched = sched
        self.params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
        self.count = 0

    def __call__(self, ids: list[int]) -> float:
        from srt.transport.io_struct import TokenizedGenerateReq

        self.count += 1
        self.sched.process_input_requests([TokenizedGenerateReq(f"ab{self.count}", tuple(ids), self.params)])
        t = time.perf_counter()
        self.sched.step()
        dt = time.perf_counter() - t
        while self.sched.running or self.sched.waiting:
            self.sched.step()
        return dt * 1e3
