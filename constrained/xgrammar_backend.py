"""xgrammar backend: JSON schema, regex, EBNF (GBNF style, ``root ::= ...``), choice and
structural tags. Compiled grammars are shared; each request gets its own GrammarMatcher."""
from __future__ import annotations

import json

import torch
import xgrammar as xgr

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from constrained.grammar_config import GrammarBackendConfig, split_json_layout
from constrained.json_number_bounds import XGRAMMAR_BOUNDS, bound_number_rule, bound_numbers
from constrained.schema_coverage import StrictSchemaError, xgrammar_gaps
from constrained.tag_parts import map_parts, tag_parts
from constrained.tag_plan import TagPlan, plan_tag


MAX_EXPORT_BYTES = 8 * 1024 * 1024  # compiled grammars larger than this are not exported


class XGrammarMaskFiller:
    """Fills many rows with xgrammar's batch matcher (C++ threads)."""

    def __init__(self) -> None:
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def fill(self, grammars: list["XGrammarGrammar"], vocab_mask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], vocab_mask, rows)


class JumpForwardTokenizer:
    """Turns xgrammar's jump-forward string (the text the grammar forces next) into tokens
    that are safe to force. SGLang's jump-forward re-tokenised the text together with the
    tokens before it and rolled those back, which broke on byte-level boundaries and with
    its overlap scheduler until it was removed; here nothing already generated changes:
    the forced text is tokenised alone and its last token is dropped, because the model's
    next free choice may merge with it (``year"`` + ``:`` is the single token ``":``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:-1]
        # Tokenizers that prepend a space marker (SentencePiece) would force text the
        # grammar did not ask for: then force nothing.
        if ids and not text.startswith(self.tokenizer.decode(ids)):
            return []
        return ids


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, compiled: xgr.CompiledGrammar, mask_filler: XGrammarMaskFiller = None,
                 jump_forward: JumpForwardTokenizer = None) -> None:
        super().__init__()
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask_filler = mask_filler
        self.jump_forward = jump_forward

    def accept_token(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the grammar")

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)

    def allows_token(self, token: int) -> bool:
        # xgrammar has no check that leaves the state alone: accept, then undo (~us each).
        if not self.matcher.accept_token(token):
            return False  # a rejected token leaves the matcher unchanged
        self.matcher.rollback(1)
        return True

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    def fast_forward(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or self.jump_forward is None:
            return []
        text = self.matcher.find_jump_forward_string()  # ~2 us; usually empty
        if not text:
            return []
        forced = []
        for token in self.jump_forward(text)[:max_tokens]:
            if not self.matcher.accept_token(token):  # never expected: stop forcing here
                break
            forced.append(token)
        return forced

    def export(self) -> tuple[str, bytes]:
        # xgrammar's only format is JSON, ~25x the grammar's memory and growing faster than
        # it: 2 MB grammars export in ~0.1 s, a 16 MB one to 400 MB in 20 s, and some need
        # more than 8 GB. Past MAX_EXPORT_BYTES the rank compiles it again instead.
        if self.compiled.memory_size_bytes > MAX_EXPORT_BYTES:
            return "rebuild", b""
        return "xgrammar", self.compiled.serialize_json().encode()

    def copy(self) -> "XGrammarGrammar":
        twin = XGrammarGrammar(self.compiled, self.mask_filler, self.jump_forward)
        twin.stats.dispatch_type = self.stats.dispatch_type
        return twin


class XGrammarGrammarBackend(BaseGrammarBackend):
    name = "xgrammar"
    supports_json_layout = True

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, config: GrammarBackendConfig) -> None:
        super().__init__(config.num_threads, config.cache_size)
        if config.json.whitespace_pattern is not None:
            raise ValueError("xgrammar does not support --constrained-json-whitespace-pattern")
        # One internal thread per compile: our pool already runs compiles side by side.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self.tokenizer_info = tokenizer_info
        self.json = config.json
        self.mask_filler = XGrammarMaskFiller()
        self.jump_forward = None  # set by from_tokenizer: fast-forward needs the tokenizer

    @classmethod
    def from_tokenizer(cls, tokenizer, config: GrammarBackendConfig) -> "XGrammarGrammarBackend":
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=config.vocab_size, stop_token_ids=list(config.eos_token_ids))
        backend = cls(info, config)
        backend.jump_forward = JumpForwardTokenizer(tokenizer)
        return backend

    def load(self, fmt: str, data: bytes) -> XGrammarGrammar:
        """A grammar the compile pool compiled (``XGrammarGrammar.export``)."""
        if fmt != "xgrammar":
            raise ValueError(f"the xgrammar backend cannot load a {fmt!r} grammar")
        return self._grammar(xgr.CompiledGrammar.deserialize_json(data.decode(), self.tokenizer_info))

    def _grammar(self, compiled: xgr.CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(compiled, self.mask_filler, self.jump_forward)

    def compile_json_schema(self, spec: str, strict: bool) -> XGrammarGrammar:
        # xgrammar does not say what it drops: schema_coverage's measured whitelist does.
        gaps = xgrammar_gaps(json.loads(spec))
        if strict and gaps:
            raise StrictSchemaError(gaps, "the xgrammar grammar backend does not enforce")
        value = self.dispatch_json_schema(spec)
        value.stats.gaps = tuple(str(g) for g in gaps)
        return value

    def dispatch_json_schema(self, spec: str) -> XGrammarGrammar:
        spec, opts = split_json_layout(spec, self.json)
        if opts.whitespace_pattern is not None:
            raise ValueError("xgrammar has no JSON whitespace patterns: whitespace_pattern needs "
                             "--grammar-backend llguidance, outlines or auto")
        if opts.disable_any_whitespace:  # compact, not xgrammar's default ", " / ": "
            layout = {"any_whitespace": False, "separators": (",", ":")}
        else:
            layout = {"any_whitespace": True, "max_whitespace_cnt": opts.max_whitespace or None}
        if opts.unbounded_numbers:
            compiled = self.compiler.compile_json_schema(spec, **layout)
        else:  # what compile_json_schema compiles, with bounded numbers (json_number_bounds.py)
            spec = json.dumps(bound_numbers(json.loads(spec), XGRAMMAR_BOUNDS))
            ebnf = str(xgr.Grammar.from_json_schema(spec, **layout))
            compiled = self.compiler.compile_grammar(bound_number_rule(ebnf))
        return self._grammar(compiled)

    def dispatch_regex(self, spec: str) -> XGrammarGrammar:
        return self._grammar(self.compiler.compile_regex(spec))

    def dispatch_ebnf(self, spec: str) -> XGrammarGrammar:
        return self._grammar(self.compiler.compile_grammar(spec, root_rule_name="root"))

    def dispatch_choice(self, spec: str) -> XGrammarGrammar:
        # JSON string literals are valid EBNF literals (checked for quotes, backslashes,
        # control characters and non-ASCII).
        choices = json.loads(spec)
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return self._grammar(self.compiler.compile_grammar(ebnf))

    def dispatch_structural_tag(self, spec: str) -> XGrammarGrammar:
        tag = json.loads(spec)
        return self.compile_structural_tag(tag, plan_tag(tag_parts(tag), "xgrammar", self.json))

    def compile_structural_tag(self, tag: dict, plan: TagPlan) -> XGrammarGrammar:
        """The tag with our keywords stripped and numbers bounded as in json_schema (schema
        bounds for integers, the bounded ``basic_number`` rule in the EBNF xgrammar prints)."""
        def library_schema(part):
            return part.schema if self.json.unbounded_numbers else bound_numbers(part.schema, XGRAMMAR_BOUNDS)

        lib = map_parts(tag, library_schema)
        if "format" in lib:  # xgrammar's own structural-tag format
            grammar = xgr.Grammar.from_structural_tag(json.dumps(lib))
        else:  # SGLang's format: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in _structures(lib)]
            grammar = xgr.Grammar.from_structural_tag(items, list(lib["triggers"]))
        ebnf = str(grammar)
        if not self.json.unbounded_numbers and "\nbasic_number ::=" in "\n" + ebnf:
            ebnf = bound_number_rule(ebnf)
        value = self._grammar(self.compiler.compile_grammar(ebnf))
        value.stats.gaps = plan.gaps
        return value


def _structures(tag: dict) -> list[dict]:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError('structural_tag needs non-empty "structures" and "triggers" lists')
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
            raise ValueError('each structure needs "begin", "schema" and "end"')
    return structures
