"""Incremental detokenization for one request (SGLang / vLLM style).

Decoding each new token on its own is wrong: byte-level BPE splits one UTF-8 character
over several tokens (a lone piece decodes to "\\ufffd"), and SentencePiece drops the
leading space of the first decoded piece. So we decode a window that starts a few tokens
*before* the new ones (the "surrogate" prefix), keep only what it adds beyond the
prefix's own text, and hold the new tokens back while their text ends in "\\ufffd".

Stop strings: the scheduler finishes a request when its text contains a stop string; the
user must never see the stop string, so the visible text is cut before its first
occurrence, and while streaming, a tail that could still grow into a stop string is
held back. The visible text is therefore append-only: every streamed text is a prefix
of the final one.
"""
from __future__ import annotations

from typing import Optional, Sequence

# How many prompt tokens to decode in front of the output (SGLang uses 5).
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5


class DecodeState:
    """Stable decoded text of one request's output tokens."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        prefix = list(prompt_ids[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:])
        # _ids = prompt prefix + output; offsets index into it.
        self._ids: list[int] = prefix
        self._surr_offset = 0
        self._read_offset = len(prefix)
        self.decoded_text = ""  # stable text of the output tokens consumed so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(
            list(ids),
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,  # cleanup rewrites earlier text: not append-only
        )

    def add_tokens(self, new_ids: Sequence[int], flush: bool = False) -> None:
        """Append output tokens; ``flush`` (at finish) also emits an incomplete character."""
        self._ids.extend(int(t) for t in new_ids)
        if self._read_offset >= len(self._ids):
            return
        surr_text = self._decode(self._ids[self._surr_offset : self._read_offset])
        new_text = self._decode(self._ids[self._surr_offset :])
        if len(new_text) > len(surr_text) and (flush or not new_text.endswith("\ufffd")):
            self.decoded_text += new_text[len(surr_text) :]
            self._surr_offset = self._read_offset
            self._read_offset = len(self._ids)

    def visible_text(self, finished: bool, matched_stop: Optional[str] = None) -> str:
        """Text to show the user: cut at a stop string; while running, hold back a
        tail that may still become one."""
        return trim_stop(self.decoded_text, self._stop, finished, matched_stop)


def trim_stop(
    text: str, stop: Sequence[str], finished: bool, matched_stop: Optional[str] = None
) -> str:
    """Cut ``text`` before the earliest stop string; if not finished, also before any
    suffix that is a proper prefix of a stop string (it may complete next step)."""
    stops = tuple(stop) + ((matched_stop,) if matched_stop and matched_stop not in stop else ())
    cut = len(text)
    for s in stops:
        pos = text.find(s)
        if pos != -1:
            cut = min(cut, pos)
    if not finished and cut == len(text):
        hold = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        cut -= hold
    return text[:cut]
