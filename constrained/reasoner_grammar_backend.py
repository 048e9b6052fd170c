"""Thinking models (``--reasoning-parser``): a request that reasons first generates freely
until the think-end token, and only then does its constraint start.

Whether a request reasons is per request (``require_reasoning``, set by the frontend from
the chat template's thinking switch); ``maybe_init_reasoning`` tells the grammar."""
from __future__ import annotations

import torch

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, GrammarKey
from constrained.grammar_config import THINK_END_TOKENS


class ReasonerGrammarObject(BaseGrammarObject):
    def __init__(self, grammar: BaseGrammarObject, think_end_id: int) -> None:
        super().__init__()
        self.grammar = grammar
        self.stats = grammar.stats
        self.think_end_id = think_end_id
        self.is_in_reasoning = False
        self.max_rollback = grammar.max_rollback

    def maybe_init_reasoning(self, reasoning: bool) -> None:
        self.is_in_reasoning = reasoning

    def accept_token(self, token: int) -> None:
        if self.is_in_reasoning:
            self.is_in_reasoning = token != self.think_end_id
            return
        self.grammar.accept_token(token)

    def rollback(self, k: int) -> None:
        if not self.is_in_reasoning:  # tokens before the think end were never accepted
            self.grammar.rollback(k)

    def is_terminated(self) -> bool:
        return not self.is_in_reasoning and self.grammar.is_terminated()

    def needs_vocab_mask(self) -> bool:
        return not self.is_in_reasoning and super().needs_vocab_mask()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        if self.is_in_reasoning:
            vocab_mask[idx].fill_(-1)
        else:
            self.grammar.fill_vocab_mask(vocab_mask, idx)

    def has_error(self) -> bool:
        return not self.is_in_reasoning and self.grammar.has_error()

    def fast_forward(self, max_tokens: int) -> list[int]:
        return [] if self.is_in_reasoning else self.grammar.fast_forward(max_tokens)

    def mask_source(self) -> BaseGrammarObject:
        return self.grammar.mask_source()  # asked only for rows past the think end

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
        return ReasonerGrammarObject(self.backend.dispatch(key), self.think_end_id)

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
