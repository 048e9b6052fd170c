"""Thinking models (``--reasoning-parser``): a request that reasons first generates freely
until the think-end token, and only then does its constraint start.

Whether a request reasons is per request (``require_reasoning``, decided by the frontend in
srt/frontend/reasoning_parser.py); ``maybe_init_reasoning`` tells the grammar, with the
request's ``thinking_budget``."""
from __future__ import annotations

from typing import Optional

import torch

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, GrammarKey
from constrained.free_grammar import FreeGrammarObject
from constrained.grammar_config import FREE_GRAMMAR_KEY, THINK_END_TOKENS


class ReasonerGrammarObject(BaseGrammarObject):
    """``grammar`` from the think end on. Counts what it accepted on each side of the think
    end, so ``rollback`` is exact across it (a speculative walk may cross it), and enforces
    the request's ``thinking_budget``: once that many tokens were accepted while reasoning,
    its mask allows only the think end (and fast-forward forces it)."""

    def __init__(self, grammar: BaseGrammarObject, think_end_id: int) -> None:
        super().__init__()
        self.grammar = grammar
        self.stats = grammar.stats
        self.think_end_id = think_end_id
        self.is_in_reasoning = False
        self.budget: Optional[int] = None  # thinking_budget: most tokens before the think end
        self.thought = 0  # tokens accepted while reasoning (the think end not counted)
        self.ended = False  # the think end was accepted (False too for a request that never reasoned)
        self.after = 0  # tokens accepted into ``grammar``
        self.max_rollback = grammar.max_rollback

    def maybe_init_reasoning(self, reasoning: bool, budget: Optional[int] = None) -> None:
        self.is_in_reasoning, self.budget = reasoning, budget

    def budget_reached(self) -> bool:
        return self.is_in_reasoning and self.budget is not None and self.thought >= self.budget

    def accept_token(self, token: int) -> None:
        if not self.is_in_reasoning:
            self.grammar.accept_token(token)
            self.after += 1
        elif token == self.think_end_id:
            self.is_in_reasoning, self.ended = False, True
        elif self.budget_reached():
            raise ValueError(f"thinking_budget {self.budget} reached: only the think end may follow")
        else:
            self.thought += 1

    def rollback(self, k: int) -> None:
        inner = min(k, self.after)  # the newest tokens are the grammar's
        if inner:
            self.grammar.rollback(inner)
            self.after -= inner
            k -= inner
        if k and self.ended:  # back across the think end
            self.is_in_reasoning, self.ended = True, False
            k -= 1
        if k > self.thought:
            raise ValueError(f"rollback past the first token ({k} more than accepted)")
        self.thought -= k

    def is_terminated(self) -> bool:
        return not self.is_in_reasoning and self.grammar.is_terminated()

    def needs_vocab_mask(self) -> bool:
        if self.is_in_reasoning:
            return not self.finished and self.budget_reached()
        return not self.finished and self.grammar.needs_vocab_mask()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        if not self.is_in_reasoning:
            self.grammar.fill_vocab_mask(vocab_mask, idx)
        elif self.budget_reached():
            vocab_mask[idx].zero_()
            bit = self.think_end_id & 31  # int32 words: bit 31 is the sign bit
            vocab_mask[idx, self.think_end_id >> 5] = -(1 << 31) if bit == 31 else 1 << bit
        else:
            vocab_mask[idx].fill_(-1)

    def has_error(self) -> bool:
        return not self.is_in_reasoning and self.grammar.has_error()

    def allows_token(self, token: int) -> Optional[bool]:
        if not self.is_in_reasoning:
            return self.grammar.allows_token(token)
        return token == self.think_end_id if self.budget_reached() else True

    def fast_forward(self, max_tokens: int) -> list[int]:
        forced = []
        if self.budget_reached() and max_tokens > 0:
            self.accept_token(self.think_end_id)
            forced, max_tokens = [self.think_end_id], max_tokens - 1
        if self.is_in_reasoning or max_tokens <= 0:
            return forced
        inner = self.grammar.fast_forward(max_tokens)
        self.after += len(inner)
        return forced + inner

    def mask_source(self) -> BaseGrammarObject:
        # While reasoning (a budget row) this object fills its own row, one by one.
        return self if self.is_in_reasoning else self.grammar.mask_source()

    def export(self) -> tuple[str, bytes]:
        return self.grammar.export()

    def copy(self) -> "ReasonerGrammarObject":
        return ReasonerGrammarObject(self.grammar.copy(), self.think_end_id)


class ReasonerGrammarBackend(BaseGrammarBackend):
    """Wraps any backend; compiles with it, caches the wrapped objects itself."""

    def __init__(self, backend: BaseGrammarBackend, think_end_id: int,
                 num_threads: int = 2, cache_size: int = 1024) -> None:
        super().__init__(num_threads, cache_size)
        self.backend, self.think_end_id = backend, think_end_id
        self.metrics = backend.metrics  # one set of counters (auto counts its fallbacks there)
        self.name = f"{backend.name}+reasoner"

    def dispatch(self, key: GrammarKey) -> BaseGrammarObject:
        inner = FreeGrammarObject() if tuple(key) == FREE_GRAMMAR_KEY else self.backend.dispatch(key)
        return ReasonerGrammarObject(inner, self.think_end_id)

    def can_use_compile_pool(self) -> bool:
        return self.backend.can_use_compile_pool()

    def load(self, fmt: str, data: bytes) -> BaseGrammarObject:
        return ReasonerGrammarObject(self.backend.load(fmt, data), self.think_end_id)

    def shutdown(self) -> None:
        self.backend.shutdown()
        super().shutdown()


def think_end_token_id(tokenizer, reasoning_parser: str) -> int:
    text = THINK_END_TOKENS[reasoning_parser]
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"--reasoning-parser {reasoning_parser}: the tokenizer has no single "
                         f"{text} token (it encodes to {ids})")
    return ids[0]
