"""llguidance backend: JSON schema, regex, EBNF (GBNF or Lark), choice and structural tags.

llguidance compiles lazily with bounded "fuel" (``LLParserLimits``), so a pathological
grammar fails with an error instead of running for minutes. Each request gets a
``deep_copy`` of a pristine matcher (microseconds)."""
from __future__ import annotations

import json
import re

import llguidance as llg
import llguidance.hf
import llguidance.torch
import torch

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, clean_error
from constrained.grammar_config import GrammarBackendConfig, JsonOptions, split_json_layout
from constrained.json_number_bounds import LLGUIDANCE_BOUNDS, bound_numbers
from constrained.json_one_of import exclusive_one_of
from constrained.schema_coverage import (
    STANDARD_FORMATS, Gap, StrictSchemaError, keyword_gaps, schema_nodes,
)
from constrained.structural_tag_lark import structural_tag_to_lark
from constrained.xgrammar_backend import _structures

_WHITESPACE = r"[\x20\x0A\x0D\x09]"


def close_objects(schema):
    """Objects with ``properties`` but no ``additionalProperties`` get ``false``, as
    xgrammar's strict mode (and OpenAI's strict schemas) do, so both backends -- and auto's
    fallback -- generate the same shape instead of inventing extra keys. Not inside allOf,
    nor in a schema an allOf branch refers to: closing each branch would make the
    conjunction unsatisfiable."""
    shared: set[str] = set()
    _all_of_refs(schema, False, shared)
    return _close(schema, "#", False, shared)


def _all_of_refs(node, in_all_of: bool, found: set[str]) -> None:
    pairs = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ()
    for key, value in pairs:
        if in_all_of and key == "$ref" and isinstance(value, str):
            found.add(value)
        elif key not in ("enum", "const", "default", "examples"):
            _all_of_refs(value, in_all_of or key == "allOf", found)


def _close(node, path: str, in_all_of: bool, shared: set[str]):
    if isinstance(node, list):
        return [_close(n, f"{path}/{i}", in_all_of, shared) for i, n in enumerate(node)]
    if not isinstance(node, dict):
        return node
    in_all_of = in_all_of or path in shared
    out = {}
    for key, value in node.items():
        if key in ("enum", "const", "default", "examples"):  # data, not schema
            out[key] = value
        else:
            sub = f"{path}/{key.replace('~', '~0').replace('/', '~1')}"
            out[key] = _close(value, sub, in_all_of or key == "allOf", shared)
    if ("properties" in out and not in_all_of and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


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
    """Fills many rows with llguidance's executor (Rust threads)."""

    def __init__(self) -> None:
        self.executor = llg.LLExecutor()

    def fill(self, grammars: list["GuidanceGrammar"], vocab_mask: torch.Tensor, rows: list[int]) -> None:
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(g.matcher, i) for g, i in zip(grammars, rows)], vocab_mask)


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

    def is_terminated(self) -> bool:
        # Stopped = only EOS could follow (or EOS was taken): the output is complete.
        return self.matcher.is_stopped()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, vocab_mask, idx)

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


_DRAFTS = re.compile(r"^https?://json-schema\.org/(draft-0[3467]/schema|draft/20(19-09|20-12)/schema)#?$")


def without_unknown_draft(schema):
    """The schema without a ``$schema`` that names no JSON Schema draft (Snowplow's
    ``iglu:`` URIs): llguidance would try to resolve it, and fail; validators read 2020-12."""
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str) and not _DRAFTS.match(schema["$schema"]):
        return {k: v for k, v in schema.items() if k != "$schema"}
    return schema


def _warnings(grammar: str) -> list[str]:
    return list(llg.LLMatcher.validate_grammar_with_warnings(grammar)[1])


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


def lenient_gaps(schema, warnings: list[str]) -> list:
    """Where the keywords llguidance's lenient mode says it dropped are (schema_coverage)."""
    keywords, formats = set(), set()
    for w in warnings:
        for found in _UNIMPLEMENTED.findall(w):
            keywords.update(json.loads(found))
        formats.update(_UNKNOWN_FORMAT.findall(w))
        if "oneOf" in w:
            keywords.add("oneOf")
    gaps = keyword_gaps(schema, keywords)
    if formats & STANDARD_FORMATS:  # others are annotations: no validator asserts them
        gaps += [Gap("format", path) for node, path in schema_nodes(schema)
                 if node.get("format") in formats & STANDARD_FORMATS]
    return gaps


def _json_overrides(opts: JsonOptions) -> dict:
    if opts.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    if opts.whitespace_pattern is not None:
        return {"whitespace_pattern": opts.whitespace_pattern}
    if opts.max_whitespace:
        return {"whitespace_pattern": f"{_WHITESPACE}{{0,{opts.max_whitespace}}}"}
    return {"whitespace_flexible": True}


class GuidanceBackend(BaseGrammarBackend):
    name = "llguidance"
    supports_json_layout = True

    def __init__(self, ll_tokenizer: llg.LLTokenizer, config: GrammarBackendConfig) -> None:
        super().__init__(config.num_threads, config.cache_size)
        self.tokenizer = ll_tokenizer
        self.mask_filler = GuidanceMaskFiller()
        self.json_options = config.json
        self.unbounded_numbers = config.json.unbounded_numbers
        self.json_overrides = _json_overrides(config.json)

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
        try:
            return self.dispatch_json_schema(spec)
        except ValueError as refused:
            try:
                value, warnings, compiled = self._json_matcher(spec, lenient=True)
            except ValueError as e:
                raise ValueError(f"{clean_error(refused)}; in lenient mode: {clean_error(e)}") from None
        gaps = lenient_gaps(compiled, warnings)  # paths: the compiled schema keeps the user's
        if not gaps and not warnings:  # refused for a reason lenient mode does not name
            gaps = [f"(llguidance: {clean_error(refused)})"]
        if strict and gaps:
            raise StrictSchemaError(gaps, "the llguidance grammar backend does not enforce")
        value.stats.gaps = tuple(str(g) for g in gaps)
        return value

    def dispatch_json_schema(self, spec: str) -> GuidanceGrammar:
        return self._json_matcher(spec, lenient=False)[0]

    def _json_matcher(self, spec: str, lenient: bool) -> tuple[GuidanceGrammar, list[str], object]:
        """(matcher, llguidance's warnings, the schema compiled). Lenient: unsupported keywords
        dropped, oneOf read as anyOf (after narrowing what json_one_of can make exact)."""
        spec, opts = split_json_layout(spec, self.json_options)
        overrides = self.json_overrides if opts is self.json_options else _json_overrides(opts)
        defaults = {"lenient": True, "coerce_one_of": True} if lenient else None
        schema = close_objects(without_unknown_draft(json.loads(spec)))
        if not self.unbounded_numbers:
            schema = bound_numbers(schema, LLGUIDANCE_BOUNDS)
        if lenient and "oneOf" in spec:
            schema = exclusive_one_of(schema) or schema
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=defaults, overrides=overrides)
            return self._matcher(grammar), _warnings(grammar) if lenient else [], schema
        except ValueError as e:  # oneOf it cannot prove disjoint: narrow closed-object branches
            exclusive = exclusive_one_of(schema) if "oneOf" in str(e) else None
            if exclusive is None:
                raise
            grammar = llg.LLMatcher.grammar_from_json_schema(exclusive, defaults=defaults, overrides=overrides)
            return self._matcher(grammar), [], exclusive

    def _tag_schema(self, schema, max_whitespace):
        """A structural tag's JSON schema with this backend's JSON options (as
        dispatch_json_schema applies them); the tag's own whitespace bound wins."""
        if not isinstance(schema, dict):
            return schema
        schema = close_objects(schema)
        if not self.unbounded_numbers:
            schema = bound_numbers(schema, LLGUIDANCE_BOUNDS)
        opts = dict(self.json_overrides)
        if max_whitespace and opts.get("whitespace_flexible") is not False:
            opts = {"whitespace_pattern": f"{_WHITESPACE}{{0,{max_whitespace}}}"}
        return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **opts}}

    def dispatch_regex(self, spec: str) -> GuidanceGrammar:
        return self._matcher(llg.LLMatcher.grammar_from_regex(ascii_shorthands(spec)))

    def dispatch_ebnf(self, spec: str) -> GuidanceGrammar:
        return self._matcher(llg.grammar_from("ebnf", spec))

    def dispatch_choice(self, spec: str) -> GuidanceGrammar:
        return self._matcher(llg.grammar_from("choice", spec))

    def dispatch_structural_tag(self, spec: str) -> GuidanceGrammar:
        tag = json.loads(spec)
        if "format" in tag:  # xgrammar's format style (a subset): tool calls use it
            return self._matcher(llg.LLMatcher.grammar_from_lark(structural_tag_to_lark(tag, self._tag_schema)))
        tags = []
        for s in _structures(tag):
            trigger = next((t for t in tag["triggers"] if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger is a prefix of begin {s['begin']!r}")
            tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
        return self._matcher(llg.LLMatcher.grammar_from_lark(llg.StructTag.to_grammar(tags, assume_special=False)))
