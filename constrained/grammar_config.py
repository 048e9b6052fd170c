"""Frozen options every grammar backend is built from (derived from ServerArgs once)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class JsonOptions:
    disable_any_whitespace: bool = False  # compact separators "," and ":", no whitespace
    whitespace_pattern: Optional[str] = None  # regex between JSON tokens (llguidance)
    max_whitespace: int = 16  # whitespace characters allowed between tokens (0: unbounded)
    unbounded_numbers: bool = False  # True: no default digit bounds (json_number_bounds.py)


@dataclass(frozen=True)
class GrammarBackendConfig:
    vocab_size: int  # the model's (logits') vocabulary size: the bitmask covers it all
    eos_token_ids: tuple[int, ...]
    json: JsonOptions = field(default_factory=JsonOptions)
    num_threads: int = 2
    cache_size: int = 1024

    @classmethod
    def from_server_args(cls, server_args, vocab_size: int,
                         eos_token_ids: tuple[int, ...]) -> "GrammarBackendConfig":
        return cls(
            vocab_size=vocab_size, eos_token_ids=tuple(eos_token_ids),
            json=JsonOptions(server_args.constrained_json_disable_any_whitespace,
                             server_args.constrained_json_whitespace_pattern,
                             server_args.constrained_json_max_whitespace,
                             server_args.constrained_json_unbounded_numbers),
            num_threads=server_args.grammar_compile_threads,
            cache_size=server_args.grammar_cache_size)
