"""Thinking models (``--reasoning-parser``): whether a request reasons, and its output split
into the thinking (``reasoning_content``) and the answer (``content``), whole or streamed.

The split follows the grammar exactly (constrained/reasoner_grammar_backend.py): a request
that reasons is thinking from its first output token until the think end, and the constraint
starts right after it, so the constrained document is always in the answer, never in the
thinking. The markers themselves are in neither field: a leading think start (qwen3 writes
``<think>`` first; the others open it in the prompt) and the think end are dropped, and so is
the whitespace between the think end and the answer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from constrained.grammar_config import THINK_END_TOKENS

THINK_START = "<think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    think_end: str
    # Thinking has a per-request switch (chat_template_kwargs.enable_thinking, default on;
    # off, the template closes the think block in the prompt). deepseek-r1 has none.
    switchable: bool = True


FORMATS = {name: ReasoningFormat(name, end, name != "deepseek-r1") for name, end in THINK_END_TOKENS.items()}


def request_reasons(reasoning_parser: Optional[str], chat_template_kwargs: Optional[dict]) -> bool:
    """Does this chat request start its output thinking? The one place that decides it: the
    grammar (``require_reasoning``) and the response split both follow this answer."""
    if not reasoning_parser:
        return False
    if not FORMATS[reasoning_parser].switchable:
        return True
    return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One choice's text, fed in pieces: ``feed`` and ``finish`` return (reasoning, content)
    deltas. Streaming-safe: text that may be the start of a marker is held back until the
    next piece tells. ``keep_markers`` (``separate_reasoning: false``): the thinking, markers
    and all, is returned as reasoning so the caller can send it as content verbatim."""

    def __init__(self, think_end: Optional[str], in_reasoning: bool, keep_markers: bool = False) -> None:
        self.think_end = think_end
        self.in_reasoning = in_reasoning and think_end is not None
        self.keep_markers = keep_markers
        self.started = False  # past the place a leading think start could be
        self.answer_started = False  # past the whitespace after the think end
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self.in_reasoning:
            if not self.started:
                if not final and len(self.buf) < len(THINK_START) and THINK_START.startswith(self.buf):
                    return "", ""  # maybe the think start
                self.started = True
                if self.buf.startswith(THINK_START):
                    reasoning += THINK_START if self.keep_markers else ""
                    self.buf = self.buf[len(THINK_START):]
            at = self.buf.find(self.think_end)
            if at < 0:
                keep = 0 if final else _held_tail(self.buf, self.think_end)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning += self.buf[:at] + (self.think_end if self.keep_markers else "")
            self.buf = self.buf[at + len(self.think_end):]
            self.in_reasoning = False
        elif self.think_end is None or not self.started:
            self.answer_started = True  # never reasoned: the text is the answer as it is
        self.started = True
        if not self.answer_started:
            stripped = self.buf.lstrip()
            if self.keep_markers:
                reasoning += self.buf[:len(self.buf) - len(stripped)]
            self.buf = stripped
            self.answer_started = bool(stripped)
        content, self.buf = self.buf, ""
        return reasoning, content


@dataclass(frozen=True)
class ReasoningSplit:
    """A chat request's split: the server's format, whether the request reasons, and
    ``separate_reasoning`` (False: the thinking stays in content, verbatim)."""

    think_end: Optional[str] = None
    in_reasoning: bool = False
    separate: bool = True

    @classmethod
    def of(cls, reasoning_parser: Optional[str], in_reasoning: bool, separate: bool) -> "ReasoningSplit":
        fmt = FORMATS.get(reasoning_parser or "")
        return cls(fmt.think_end if fmt else None, in_reasoning and fmt is not None, separate)

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.think_end, self.in_reasoning, keep_markers=not self.separate)

    def split(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning, answer) of a whole output; reasoning None when there was none, or
        when it goes to content (then it is the answer's verbatim prefix: see ``message``)."""
        p = self.parser()
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return (r1 + r2) or None, c1 + c2

    def message(self, reasoning: Optional[str], fields: dict[str, Any]) -> dict[str, Any]:
        """A finished message's fields with its thinking put where the request asked."""
        if not reasoning:
            return fields
        if self.separate:
            return {**fields, "reasoning_content": reasoning}
        return {**fields, "content": reasoning + (fields.get("content") or "")}

    def delta(self, reasoning: str) -> list[dict[str, Any]]:
        """A streamed thinking delta as DeltaMessage fields ([] when empty)."""
        if not reasoning:
            return []
        return [{"reasoning_content": reasoning}] if self.separate else [{"content": reasoning}]
