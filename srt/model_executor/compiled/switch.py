"""When the compiled steps serve instead of the eager ones.

TP=1: as soon as they are ready (nobody to stay in step with). TP > 1: from the scheduler
iteration in which every rank of the group agreed they are ready
(``distributed/compile_agreement.py``); a kind of step (decode, prefill) that failed to
compile on any rank stays eager on all of them. A graph that fails later, at run time,
falls back to eager on that rank only: each layer's output is all-reduced, so every rank
still holds the same activations and logits.
"""
from __future__ import annotations

import logging
from typing import Optional

from distributed.compile_agreement import COMPILED, PENDING, UNUSED, agree_on_compiled_steps
from distributed.parallel_state import TPGroup
from srt.model_executor.compiled.decode import CompiledDecode
from srt.model_executor.compiled.prefill import CompiledPrefill
from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


class CompiledSwitch:
    def __init__(self, decode: Optional[CompiledDecode], prefill: Optional[CompiledPrefill],
                 tp: TPGroup, log_prefix: str):
        self.decode, self.prefill, self.tp, self.log_prefix = decode, prefill, tp, log_prefix
        self.agreed: Optional[tuple[bool, bool]] = None  # (decode, prefill) once decided

    @property
    def pending(self) -> bool:
        """A collective per iteration is still due (identical on every rank: the decision
        came from a collective, and whether anything compiles comes from the flags)."""
        return self.decode is not None and not self.tp.is_single and self.agreed is None

    def agree(self) -> Optional[tuple[bool, bool]]:
        """Every rank, once per scheduler iteration. Returns ``(decode, prefill)`` in the
        iteration the switch is decided, else None."""
        if not self.pending:
            return None
        decode, prefill = agree_on_compiled_steps(self._local_states(), self.tp)
        if PENDING in (decode, prefill):
            return None
        self.agreed = (decode == COMPILED, prefill == COMPILED)
        logger.info("%s every rank is done compiling: compiled decode %s, compiled prefill %s "
                    "from this step", self.log_prefix, *("on" if a else "off" for a in self.agreed))
        return self.agreed

    def _local_states(self) -> list[int]:
        d, p = self.decode, self.prefill
        if not d.warmed_up:  # the prefill warms up first, on the same thread
            return [PENDING, PENDING]
        return [COMPILED if d.ready else UNUSED,
                COMPILED if p is not None and p.ready else UNUSED]

    def use_decode(self, fb: ForwardBatch) -> bool:
        d = self.decode
        if d is None or not d.can_run(fb):
            return False
        return self.tp.is_single or (self.agreed is not None and self.agreed[0])

    def use_prefill(self) -> bool:
        p = self.prefill
        if p is None or not p.ready:
            return False
        if self.tp.is_single:
            # Only once the whole warm-up (decode graphs too) is over: a recompile here
            # while the warm-up thread compiles with Inductor's global freezing flag on
            # would fold one layer's weights into a graph that every layer shares.
            return self.decode is None or self.decode.warmed_up
        return self.agreed is not None and self.agreed[1]
