"""Drafting for one request: n-gram tokens, cut where its grammar forbids one, with the
tokens the grammar forces taken as they are.

The grammar walks through the draft once. At each position it first asks for forced
tokens (grammar fast-forward): those join the draft marked *forced*, and verification
takes them without looking at the model, exactly as a plain step's fast-forward would
(so greedy outputs stay identical with speculation on); the n-gram proposal is then
looked up again after them. Otherwise the next n-gram token is checked against that
position's bitmask row (which verification applies there) and accepted. At the end all
of it is rolled back, so between steps a grammar only ever holds accepted tokens. A
token the grammar forbids ends the draft: no row is spent on a token that can never be
sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from srt.scheduler.req import Req
from srt.speculative.spec_state import SpecConfig


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)  # taken without sampling (fast-forward)
    # Grammar bitmask rows of the positions after each token (row j: after tokens[:j + 1]);
    # None without a grammar.
    masks: Optional[torch.Tensor] = None
    # False: the grammar forces what follows the last token, so its row is not sampled;
    # fast-forward continues from there after the step.
    bonus: bool = True


def allowed(mask_row: torch.Tensor, token: int) -> bool:
    return (int(mask_row[token >> 5]) >> (token & 31)) & 1 == 1


def make_draft(req: Req, length: int, cfg: SpecConfig, vocab_size: int, force: bool) -> Draft:
    """The request's draft of at most ``length`` tokens (``length`` > 0). ``force``: the
    grammar's forced tokens are taken as a plain step's fast-forward takes them."""
    index = req.spec.index
    index.sync(req.fill_ids)
    if req.grammar is None:
        proposal = index.propose(length, cfg.min_match, cfg.max_match)
        proposal = _cut_at_stop(proposal, req.stop_ids)
        return Draft(proposal, [False] * len(proposal))
    return GrammarWalk(req, length, cfg, vocab_size, force).run()


def _cut_at_stop(tokens: list[int], stop_ids) -> list[int]:
    """Nothing is verified past a token that would end the request."""
    for k, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:k + 1]
    return tokens


class GrammarWalk:
    """One draft through a request's grammar; the grammar ends where it started."""

    def __init__(self, req: Req, length: int, cfg: SpecConfig, vocab_size: int, force: bool):
        self.grammar = req.grammar
        if self.grammar.max_rollback is not None:  # outlines: the walk must be undone
            length = min(length, self.grammar.max_rollback - 1)
        self.req, self.length, self.cfg, self.force = req, length, cfg, force
        self.rows = self.grammar.allocate_vocab_mask(vocab_size, length + 1, "cpu")
        self.draft = Draft()
        self.accepted = 0  # tokens the grammar took (rolled back at the end)

    def run(self) -> Draft:
        g = self.grammar
        # A row without a mask (a thinking model reasoning, a pass-through grammar) is walked
        # too: the grammar counts the tokens (thinking_budget) and rolls them back exactly.
        if self.length <= 0 or g.finished or g.is_terminated() or not self._fill(0):
            return Draft()  # finished / a dead end the step reports
        try:
            self._walk()
        except ValueError:  # the library disagreed with its own mask: keep what was checked
            pass
        finally:
            if self.accepted:
                g.rollback(self.accepted)
        d = self.draft
        d.masks = self.rows[1:len(d.tokens) + 1] if d.tokens else None
        return d

    def _walk(self) -> None:
        g, d = self.grammar, self.draft
        proposal, p = self._propose(), 0
        while len(d.tokens) < self.length:
            j = len(d.tokens)
            forced = g.fast_forward(self.length - j) if self.force else []
            if forced:
                self.accepted += len(forced)
                for t in forced:
                    d.tokens.append(t)
                    d.forced.append(True)
                    if not self._fill(len(d.tokens)):
                        d.bonus = False  # the step's fast-forward forces it, as without drafts
                        return self._drop_last()
                if g.is_terminated():
                    return
                proposal, p = self._propose(), 0  # the n-gram context moved
                continue
            if p >= len(proposal) or not allowed(self.rows[j], proposal[p]):
                return
            t = proposal[p]
            p += 1
            g.accept_token(t)
            self.accepted += 1
            d.tokens.append(t)
            d.forced.append(False)
            if not self._fill(j + 1):
                return self._drop_last()
            if t in self.req.stop_ids or g.is_terminated():
                return
        if self.force and not g.is_terminated() and g.fast_forward(1):
            self.accepted += 1  # taken only to see it; the step's fast-forward takes it
            d.bonus = False

    def _propose(self) -> list[int]:
        """The n-gram continuation after the request's tokens and the draft so far."""
        index = self.req.spec.index
        base = len(index.tokens)
        index.extend(self.draft.tokens)
        try:
            return index.propose(self.length - len(self.draft.tokens), self.cfg.min_match,
                                 self.cfg.max_match)
        finally:
            index.truncate(base)

    def _drop_last(self) -> None:
        """The last token leads to a dead end: leave it to a plain step, which reports it."""
        self.draft.tokens.pop()
        self.draft.forced.pop()

    def _fill(self, j: int) -> bool:
        """Row j: the grammar's mask now; False at a dead end."""
        g, row = self.grammar, self.rows[j]
        if not g.needs_vocab_mask():
            row.fill_(-1)  # terminated: a row whose sample is never used
            return True
        g.fill_vocab_mask(self.rows, j)
        return bool(row.any()) and not g.has_error()
