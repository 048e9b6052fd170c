"""The pass-through grammar: what a request with ``thinking_budget`` but no constraint runs
under ReasonerGrammarObject, so the budget is enforced where grammars already are (TP
agreement, speculation accept/rollback, fast-forward, n > 1 copies). It allows every token,
never terminates by itself (EOS and stops end the request as without a grammar) and asks
for no mask."""
from __future__ import annotations

import torch

from constrained.base_grammar_backend import BaseGrammarObject


class FreeGrammarObject(BaseGrammarObject):
    def accept_token(self, token: int) -> None:
        pass

    def rollback(self, k: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def needs_vocab_mask(self) -> bool:
        return False

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        vocab_mask[idx].fill_(-1)

    def copy(self) -> "FreeGrammarObject":
        return FreeGrammarObject()

    def export(self) -> tuple[str, bytes]:
        return "rebuild", b""  # nothing to ship: the compile pool's client dispatches it again
