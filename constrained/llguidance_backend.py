"""llguidance backend: JSON schema, regex, EBNF (GBNF or Lark), choice and structural tags.

llguidance compiles lazily with bounded "fuel" (``LLParserLimits``), so a pathological
grammar fails with an error instead of running for minutes. Each request gets a
``deep_copy`` of a pristine matcher (microseconds)."""
from __future__ import annotations

import json

import llguidance as llg
import llguidance.hf
# llguidance.numpy, not llguidance.torch: the torch module wraps a helper we do not use in
# torch.compile at import, which loads Inductor (~6 s of CPU at every start).
import llguidance.numpy
import torch

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from constrained.grammar_config import GrammarBackendConfig
from constrained.guidance_json import (  # noqa: F401 (close_objects, lenient_gaps: re-exported)
    close_objects, guidance_gaps, json_grammar, lenient_gaps, tag_schema,
)
from constrained.schema_coverage import StrictSchemaError
from constrained.structural_tag_lark import structural_tag_to_lark
from constrained.tag_parts import map_parts, tag_parts
from constrained.tag_plan import TagPlan, plan_tag
from constrained.xgrammar_backend import _structures

_ASCII_IN_CLASS = {"d": "0-9", "w": "0-9A-Za-z_", "s": r"\t\n\x0B\f\r "}


def ascii_shorthands(regex: str) -> str:
    r"""``\d``, ``\w``, ``\s`` as ASCII classes, as xgrammar (and JSON Schema) read them.
    llguidance's regexes are Unicode-aware, so ``\d{4}`` would admit digits from any
    script and a small model happily picks them; this keeps the two backends -- and auto's
    fallback -- generating the same language."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt in _ASCII_IN_CLASS:
                out.append(_ASCII_IN_CLASS[nxt] if in_class else f"(?-u:\\{nxt})")
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        if c == "[":
            in_class = True
        elif c == "]":
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


class GuidanceMaskFiller:
    """Fills many rows with llguidance's executor (Rust threads); one row on the caller's
    thread (handing a single row to the pool only adds a thread wake-up, and on a CPU whose
    cores the forward's threads hold, a preempted one)."""

    def __init__(self) -> None:
        self.executor = llg.LLExecutor()

    def fill(self, grammars: list["GuidanceGrammar"], vocab_mask: torch.Tensor, rows: list[int]) -> None:
        if len(rows) == 1:
            llguidance.numpy.fill_next_token_bitmask(grammars[0].matcher, vocab_mask.numpy(), rows[0])
            return
        llguidance.numpy.fill_next_token_bitmask_par(
            self.executor, [(g.matcher, i) for g, i in zip(grammars, rows)], vocab_mask.numpy())


class GuidanceGrammar(BaseGrammarObject):
    def __init__(self, matcher: llg.LLMatcher, mask_filler: GuidanceMaskFiller = None,
                 source: str = "") -> None:
        super().__init__()
        self.matcher = matcher
        self.mask_filler = mask_filler
        self.source = source  # the llguidance grammar it was built from (export)

    def accept_token(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed by the grammar: {self.matcher.get_error()}")

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)

    def allows_token(self, token: int) -> bool:
        # No state change. It counts no stop token (0 for EOS where the mask allows it):
        # False then only costs the mask fill (the contract: True only where allowed).
        return self.matcher.validate_tokens([token]) == 1

    def is_terminated(self) -> bool:
        # Stopped = only EOS could follow (or EOS was taken): the output is complete.
        return self.matcher.is_stopped()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, vocab_mask.numpy(), idx)

    def has_error(self) -> bool:
        return self.matcher.is_error()

    def fast_forward(self, max_tokens: int) -> list[int]:
        # llguidance's forced tokens already stop short of a token boundary the next
        # free choice could merge with. Forced bytes cost ~1 us to check; the tokens ~8 us,
        # so they are computed only when some byte is forced.
        if max_tokens <= 0 or not self.matcher.compute_ff_bytes():
            return []
        tokens = self.matcher.compute_ff_tokens()[:max_tokens]
        if tokens and not self.matcher.consume_tokens(tokens):
            raise ValueError(f"fast-forward tokens rejected: {self.matcher.get_error()}")
        return tokens

    def export(self) -> tuple[str, bytes]:
        # Cheap to rebuild: the grammar text (the lexer is built lazily, with bounded fuel).
        return "llguidance", self.source.encode()

    def copy(self) -> "GuidanceGrammar":
        twin = GuidanceGrammar(self.matcher.deep_copy(), self.mask_filler, self.source)
        twin.stats.dispatch_type = self.stats.dispatch_type
        return twin


class GuidanceBackend(BaseGrammarBackend):
    name = "llguidance"
    supports_json_layout = True

    def __init__(self, ll_tokenizer: llg.LLTokenizer, config: GrammarBackendConfig) -> None:
        super().__init__(config.num_threads, config.cache_size)
        self.tokenizer = ll_tokenizer
        self.mask_filler = GuidanceMaskFiller()
        self.json_options = config.json

    @classmethod
    def from_tokenizer(cls, tokenizer, config: GrammarBackendConfig) -> "GuidanceBackend":
        ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=config.vocab_size, eos_token=list(config.eos_token_ids))
        return cls(ll_tokenizer, config)

    def _matcher(self, grammar: str) -> GuidanceGrammar:
        matcher = llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher, self.mask_filler, grammar)

    def load(self, fmt: str, data: bytes) -> GuidanceGrammar:
        """A grammar the compile pool checked (``GuidanceGrammar.export``)."""
        if fmt != "llguidance":
            raise ValueError(f"the llguidance backend cannot load a {fmt!r} grammar")
        return self._matcher(data.decode())

    def compile_json_schema(self, spec: str, strict: bool) -> GuidanceGrammar:
        # In its default mode llguidance refuses every keyword it does not enforce, so what
        # compiles is exact; otherwise its lenient mode drops those keywords and names them.
        gaps, lenient = guidance_gaps(spec, self.json_options)
        if strict and gaps:
            raise StrictSchemaError(gaps, "the llguidance grammar backend does not enforce")
        value = self._matcher(json_grammar(spec, self.json_options, lenient)[0])
        value.stats.gaps = tuple(str(g) for g in gaps)
        return value

    def dispatch_json_schema(self, spec: str) -> GuidanceGrammar:
        return self._matcher(json_grammar(spec, self.json_options, lenient=False)[0])

    def dispatch_regex(self, spec: str) -> GuidanceGrammar:
        return self._matcher(llg.LLMatcher.grammar_from_regex(ascii_shorthands(spec)))

    def dispatch_ebnf(self, spec: str) -> GuidanceGrammar:
        return self._matcher(llg.grammar_from("ebnf", spec))

    def dispatch_choice(self, spec: str) -> GuidanceGrammar:
        return self._matcher(llg.grammar_from("choice", spec))

    def dispatch_structural_tag(self, spec: str) -> GuidanceGrammar:
        tag = json.loads(spec)
        return self.compile_structural_tag(tag, plan_tag(tag_parts(tag), "llguidance", self.json_options))

    def compile_structural_tag(self, tag: dict, plan: TagPlan) -> GuidanceGrammar:
        """Each part exact, or lenient where the plan approximates it; our keywords gone."""
        lib = map_parts(tag, lambda p: tag_schema(p.schema, self.json_options, p.max_whitespace,
                                                  plan.lenient[p.index]))
        if "format" in lib:  # xgrammar's format style (a subset): tool calls use it
            value = self._matcher(llg.LLMatcher.grammar_from_lark(
                structural_tag_to_lark(lib, lambda schema, _max_ws: schema)))
        else:
            tags = []
            for s in _structures(lib):
                trigger = next((t for t in lib["triggers"] if s["begin"].startswith(t)), None)
                if trigger is None:
                    raise ValueError(f"no trigger is a prefix of begin {s['begin']!r}")
                tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
            value = self._matcher(llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags, assume_special=False)))
        value.stats.gaps = plan.gaps
        return value
