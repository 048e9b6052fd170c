"""outlines backend (``outlines-core``, the Rust core of Outlines): JSON schema (turned into a
regex by outlines-core), regex and choice, each compiled into a token DFA (``Index``, shared)
that every request walks with its own ``Guide``. No grammar engine: EBNF and structural tags
are refused.

Measured on outlines-core 0.2.14, and what is done about it:
- Its schema converter ignores many keywords: outlines_schema.py refuses those schemas.
- ``Guide.advance(eos)`` raises (outlines-core issue #227): EOS is handled here.
- A token running past a complete match into more text (``,`` right after ``a`` in
  ``a(,a)*``) is missing from the Index: the language served is narrower than the regex."""
from __future__ import annotations

import json
import re

import outlines_core as oc
import torch

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from constrained.grammar_config import GrammarBackendConfig, split_json_layout
from constrained.llguidance_backend import ascii_shorthands
from constrained.outlines_schema import schema_to_regex

_META = set(r"\.+*?()|[]{}^$")
MAX_ROLLBACK = 32
_NO_GRAMMARS = ("the outlines grammar backend does not support {kind} constraints: outlines-core has "
                "no EBNF or structural-tag support (only JSON schema, regex and choice); use the "
                "xgrammar or llguidance backend")


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(others))]
    return {chr(c): b for c, b in zip(chars, printable + others)}


def token_bytes(tokenizer, vocab_size: int) -> dict[int, bytes]:
    """Each generatable token id's raw bytes (special tokens left out), as outlines-core
    expects them: byte-level BPE (``Ġ`` = space) and SentencePiece (``▁``, ``<0x0A>``) undone."""
    decoder = tokenizer.backend_tokenizer.decoder
    state = json.loads(decoder.__getstate__()) if decoder is not None else {}
    kinds = {state.get("type")} | {d.get("type") for d in state.get("decoders", [])}
    byte_level = _byte_decoder() if "ByteLevel" in kinds else None
    sentencepiece = not byte_level and bool(kinds & {"ByteFallback", "Metaspace", "Replace"})
    added = tokenizer.added_tokens_decoder
    out = {}
    for text, i in tokenizer.get_vocab().items():
        if i >= vocab_size or (i in added and added[i].special):
            continue
        if i in added:
            out[i] = added[i].content.encode()
        elif byte_level is not None:  # a character outside the table: not generatable text
            if all(c in byte_level for c in text):
                out[i] = bytes(byte_level[c] for c in text)
        elif sentencepiece and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            out[i] = bytes([int(text[3:5], 16)])
        else:
            out[i] = (text.replace("\u2581", " ") if sentencepiece else text).encode()
    return {i: b for i, b in out.items() if b}


def build_vocabulary(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> oc.Vocabulary:
    eos = tuple(eos_token_ids) or (tokenizer.eos_token_id,)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in token_bytes(tokenizer, vocab_size).items():
        if i not in eos:
            by_bytes.setdefault(b, []).append(i)
    return oc.Vocabulary(eos[0], by_bytes)


class CompiledRegex:
    """One Index, shared by every request's Guide, plus facts about its states."""

    def __init__(self, index: oc.Index, eos_token_ids: tuple[int, ...]) -> None:
        self.index = index
        self.eos = frozenset(eos_token_ids)
        self.eos_bits = [(e // 32, (1 << e % 32) - (1 << 32 if e % 32 == 31 else 0)) for e in eos_token_ids]
        self._only_eos: dict[int, bool] = {}  # state -> nothing but EOS can follow

    def only_eos(self, state: int) -> bool:
        known = self._only_eos.get(state)
        if known is None:
            known = self.index.is_final_state(state) and not (
                set(self.index.get_allowed_tokens(state) or ()) - self.eos)
            self._only_eos[state] = known
        return known


class OutlinesGrammar(BaseGrammarObject):
    max_rollback = MAX_ROLLBACK
    def __init__(self, compiled: CompiledRegex) -> None:
        super().__init__()
        self.compiled = compiled
        self.guide = oc.Guide(compiled.index, max_rollback=MAX_ROLLBACK)
        self.eos_taken = False

    def accept_token(self, token: int) -> None:
        if self.eos_taken:
            raise ValueError(f"token {token} follows the end of the grammar")
        if token in self.compiled.eos:  # never given to the Guide: it would raise
            if not self.compiled.index.is_final_state(self.guide.get_state()):
                raise ValueError(f"stop token {token} before the grammar is complete")
            self.eos_taken = True
            return
        try:
            self.guide.advance(token, return_tokens=False)
        except ValueError:
            raise ValueError(f"token {token} is not allowed by the grammar") from None

    def rollback(self, k: int) -> None:
        if k and self.eos_taken:
            self.eos_taken, k = False, k - 1
        self.guide.rollback_state(k)

    def is_terminated(self) -> bool:
        return self.eos_taken or self.compiled.only_eos(self.guide.get_state())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        # Written in place; the whole row is cleared first, so padded ids stay disallowed.
        row = vocab_mask[idx]
        self.guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        if self.compiled.index.is_final_state(self.guide.get_state()):
            for word, bit in self.compiled.eos_bits:  # every stop id, not just outlines' one
                row[word] |= bit

    def export(self) -> tuple[str, bytes]:
        _, (binary,) = self.compiled.index.__reduce__()  # outlines-core's own binary form
        return "outlines", bytes(binary)

    def copy(self) -> "OutlinesGrammar":
        twin = OutlinesGrammar(self.compiled)
        twin.stats.dispatch_type = self.stats.dispatch_type
        return twin


class OutlinesGrammarBackend(BaseGrammarBackend):
    name = "outlines"
    supports_json_layout = True

    def __init__(self, vocabulary: oc.Vocabulary, config: GrammarBackendConfig) -> None:
        super().__init__(config.num_threads, config.cache_size)
        self.vocabulary = vocabulary
        self.eos_token_ids = tuple(config.eos_token_ids) or (vocabulary.get_eos_token_id(),)
        self.json_options = config.json

    @classmethod
    def from_tokenizer(cls, tokenizer, config: GrammarBackendConfig) -> "OutlinesGrammarBackend":
        return cls(build_vocabulary(tokenizer, config.vocab_size, config.eos_token_ids), config)

    def compile_regex(self, regex: str) -> OutlinesGrammar:
        # ASCII \d \w \s, as xgrammar reads them; Index() releases the GIL while it builds.
        return OutlinesGrammar(CompiledRegex(oc.Index(ascii_shorthands(regex), self.vocabulary),
                                             self.eos_token_ids))

    def load(self, fmt: str, data: bytes) -> OutlinesGrammar:
        """An index the compile pool built (``OutlinesGrammar.export``)."""
        if fmt != "outlines":
            raise ValueError(f"the outlines backend cannot load a {fmt!r} grammar")
        return OutlinesGrammar(CompiledRegex(oc.Index.from_binary(data), self.eos_token_ids))

    def compile_json_schema(self, spec: str, strict: bool) -> "OutlinesGrammar":
        # outlines_schema.adapt_schema refuses every keyword it would not enforce: exact.
        return self.dispatch_json_schema(spec)

    def dispatch_json_schema(self, spec: str) -> OutlinesGrammar:
        return self.compile_regex(schema_to_regex(*split_json_layout(spec, self.json_options)))

    def dispatch_regex(self, spec: str) -> OutlinesGrammar:
        return self.compile_regex(spec)

    def dispatch_choice(self, spec: str) -> OutlinesGrammar:
        choices = json.loads(spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice needs a non-empty list of strings")
        return self.compile_regex("|".join("".join("\\" + ch if ch in _META else ch for ch in c)
                                           for c in choices))

    def dispatch_ebnf(self, spec: str):
        raise ValueError(_NO_GRAMMARS.format(kind="ebnf"))

    def dispatch_structural_tag(self, spec: str):
        raise ValueError(_NO_GRAMMARS.format(kind="structural_tag"))
