"""N-gram drafts (SGLang's ``NGRAM``, vLLM's ``ngram``) over one request's own tokens.

Structured outputs copy: a JSON extraction repeats names and values from the document in
the prompt, a rewrite repeats most of the paragraph. The longest recent suffix of the
request's tokens (prompt + output) that occurred earlier names what may come next: the
tokens that followed that earlier occurrence.

A pure function of the token sequence, so every rank drafts the same tokens. The index
is kept per request and extended as tokens arrive (prompt once, then a few per step).
"""
from __future__ import annotations

# Occurrences of the last token examined per lookup, most recent first: bounds the cost
# on long prompts full of one frequent token (a space, a quote).
MAX_CANDIDATES = 64


class NgramIndex:
    """Where each token occurs in one request's sequence; ``propose`` drafts from it."""

    __slots__ = ("tokens", "positions")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        base = len(self.tokens)
        self.tokens.extend(tokens)
        for k, t in enumerate(tokens):
            self.positions.setdefault(t, []).append(base + k)

    def truncate(self, length: int) -> None:
        """Forget the tokens after the first ``length`` (drafted ones, tried and dropped)."""
        while len(self.tokens) > length:
            self.positions[self.tokens.pop()].pop()

    def sync(self, sequence: list[int]) -> None:
        """Catch up with ``sequence``, of which the indexed tokens are a prefix."""
        if len(sequence) > len(self.tokens):
            self.extend(sequence[len(self.tokens):])

    def propose(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the
        longest suffix (``min_n`` to ``max_n`` tokens long) of the sequence; [] if none."""
        length, at = self.best_match(min_n, max_n)
        if k <= 0 or length == 0:
            return []
        return self.tokens[at + 1:min(at + 1 + k, len(self.tokens))]

    def best_match(self, min_n: int, max_n: int) -> tuple[int, int]:
        """(length, end position) of the longest suffix match, most recent first among
        equals; (0, -1) when none is ``min_n`` tokens long."""
        seq = self.tokens
        end = len(seq)
        if end < min_n + 1:
            return 0, -1
        occurrences = self.positions.get(seq[-1], ())
        best_len, best_at = 0, -1
        # Newest first; the sequence's own last token is not a candidate.
        for n_seen, p in enumerate(reversed(occurrences)):
            if n_seen >= MAX_CANDIDATES:
                break
            if p >= end - 1:
                continue
            length = 1
            while length < max_n and p - length >= 0 and seq[p - length] == seq[end - 1 - length]:
                length += 1
            if length > best_len:
                best_len, best_at = length, p
                if length >= max_n:
                    break
        return (best_len, best_at) if best_len >= min_n else (0, -1)
