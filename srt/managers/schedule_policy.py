"""Which waiting requests join the next prefill batch (FCFS under the budgets)."""
from __future__ import annotations

from collections import deque

from srt.managers.req import Req


class PrefillAdder:
    """Admits requests in arrival order while they fit.

    KV budget: every admitted request reserves its prompt plus its remaining new tokens
    (capped at ``clip_new_tokens``, as SGLang's estimate), on top of what running requests
    still reserve, so decoding rarely runs out; if it does, the scheduler retracts.
    """

    def __init__(self, running: list[Req], available_tokens: int, max_running: int,
                 max_prefill_tokens: int, clip_new_tokens: int):
        self.available = available_tokens
        self.slots = max_running - len(running)
        self.max_prefill_tokens = max_prefill_tokens
        self.clip = clip_new_tokens
        self.reserved = sum(min(r.remaining_new_tokens(), clip_new_tokens) for r in running)
        self.busy = bool(running)

    def select(self, waiting: deque[Req]) -> list[Req]:
        picked: list[Req] = []
        extend_tokens = 0
        for req in waiting:
            if len(picked) >= self.slots:
                break
            extend = req.seqlen - req.kv_committed_len
            if picked and extend_tokens + extend > self.max_prefill_tokens:
                break
            need = extend + min(req.remaining_new_tokens(), self.clip)
            if self.busy or picked:
                if self.reserved + need > self.available:
                    break
            elif extend + 1 > self.available:
                break
            picked.append(req)
            self.reserved += need
            extend_tokens += extend
        return picked
