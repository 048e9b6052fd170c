"""Native logprobs (meta_info ``[logprob, token_id, text]`` entries) in OpenAI's shapes:
chat ``{"content": [{token, logprob, bytes, top_logprobs}]}`` and completions
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``.

A token's ``bytes`` are its exact UTF-8 bytes (a piece of a multi-byte character too),
read from xgrammar's decoded vocabulary, built once per tokenizer on first use.
"""
from __future__ import annotations

from typing import Any, Optional

from srt.entrypoints.openai_responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenTexts:
    """Text and bytes of single tokens, for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: Optional[list[bytes]] = None
        self._texts: dict[int, str] = {}  # bounded by the vocabulary; echo reads many

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        if self._bytes is None:
            import xgrammar

            self._bytes = [bytes(b) for b in xgrammar.TokenizerInfo.from_huggingface(self.tokenizer).decoded_vocab]
        if 0 <= token_id < len(self._bytes) and self._bytes[token_id]:
            return list(self._bytes[token_id])
        return list(self.text(token_id).encode("utf-8"))


def shown_entries(meta: dict, output_ids: list[int], start: int, keep_stop: bool = False) -> tuple[list, list]:
    """Output logprob entries ``start ..``: for chat, those of the tokens the user sees (a
    matched stop token at the end, hidden from the text, is left out); ``keep_stop`` keeps
    it (completions, as vLLM: lm-evaluation-harness scores with ``max_tokens: 1`` and drops
    the last entry, which must be the generated token even when it is EOS)."""
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    end = len(entries)
    fr = meta.get("finish_reason") or {}
    matched = fr.get("matched")
    if (not keep_stop and isinstance(matched, int) and not isinstance(matched, bool)
            and output_ids and output_ids[-1] == matched):
        end = min(end, len(output_ids) - 1)
    return entries[start:end], tops[start:end]


def chat_logprobs(meta: dict, output_ids: list[int], texts: TokenTexts, start: int = 0) -> ChatLogprobs:
    entries, tops = shown_entries(meta, output_ids, start)
    content = []
    for (lp, tok, _), top in zip(entries, tops):
        content.append(ChatTokenLogprob(
            token=texts.text(tok), logprob=_finite(lp), bytes=texts.bytes(tok),
            top_logprobs=[TopLogprob(token=texts.text(t), logprob=_finite(v), bytes=texts.bytes(t))
                          for v, t, _ in top]))
    return ChatLogprobs(content=content)


def completion_logprobs(meta: dict, output_ids: list[int], texts: TokenTexts, start: int = 0,
                        text_offset: int = 0) -> CompletionLogprobs:
    """``text_offset`` is where the first listed token's text starts in the choice's text.
    Every generated token is listed, a stop token that ended the request too (its text is
    not in the choice's text: its offset is the text's end)."""
    entries, tops = shown_entries(meta, output_ids, start, keep_stop=True)
    out = CompletionLogprobs()
    offset = text_offset
    for (lp, tok, _), top in zip(entries, tops):
        text = texts.text(tok)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(lp))
        out.top_logprobs.append({texts.text(t): _finite(v) for v, t, _ in top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(meta: dict, texts: TokenTexts) -> CompletionLogprobs:
    """The prompt's tokens (``echo``) from ``input_token_logprobs``, offsets from 0; the
    first token has no logprob (null, as OpenAI and vLLM send it) and no alternatives."""
    out = CompletionLogprobs()
    offset = 0
    for (lp, tok, _), top in zip(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or []):
        text = texts.text(tok)
        out.tokens.append(text)
        out.token_logprobs.append(None if lp is None else _finite(lp))
        out.top_logprobs.append(None if top is None else {texts.text(t): _finite(v) for v, t, _ in top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


def _finite(v: Any) -> float:
    """JSON has no -inf: OpenAI clients expect a number (vLLM sends -9999.0)."""
    return -9999.0 if v is None or v == float("-inf") else float(v)
