"""xgrammar backend: JSON schema, regex, EBNF (GBNF style, ``root ::= ...``), choice and
structural tags. Compiled grammars are shared; each request gets its own GrammarMatcher."""
from __future__ import annotations

import json

import torch
import xgrammar as xgr

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject
from constrained.grammar_config import GrammarBackendConfig


class XGrammarMaskFiller:
    """Fills many rows with xgrammar's batch matcher (C++ threads)."""

    def __init__(self) -> None:
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def fill(self, grammars: list["XGrammarGrammar"], vocab_mask: torch.Tensor, rows: list[int]) -> None:
        self.batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], vocab_mask, rows)


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, compiled: xgr.CompiledGrammar, mask_filler: XGrammarMaskFiller = None) -> None:
        super().__init__()
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask_filler = mask_filler

    def accept_token(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the grammar")

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    def copy(self) -> "XGrammarGrammar":
        twin = XGrammarGrammar(self.compiled, self.mask_filler)
        twin.stats.dispatch_type = self.stats.dispatch_type
        return twin


class XGrammarGrammarBackend(BaseGrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, config: GrammarBackendConfig) -> None:
        super().__init__(config.num_threads, config.cache_size)
        if config.json.whitespace_pattern is not None:
            raise ValueError("xgrammar does not support --constrained-json-whitespace-pattern")
        # One internal thread per compile: our pool already runs compiles side by side.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self.json = config.json
        self.mask_filler = XGrammarMaskFiller()

    @classmethod
    def from_tokenizer(cls, tokenizer, config: GrammarBackendConfig) -> "XGrammarGrammarBackend":
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=config.vocab_size, stop_token_ids=list(config.eos_token_ids))
        return cls(info, config)

    def dispatch_json_schema(self, spec: str) -> XGrammarGrammar:
        opts = self.json
        if opts.disable_any_whitespace:  # compact, not xgrammar's default ", " / ": "
            compiled = self.compiler.compile_json_schema(
                spec, any_whitespace=False, separators=(",", ":"))
        else:
            compiled = self.compiler.compile_json_schema(
                spec, any_whitespace=True, max_whitespace_cnt=opts.max_whitespace or None)
        return XGrammarGrammar(compiled, self.mask_filler)

    def dispatch_regex(self, spec: str) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiler.compile_regex(spec), self.mask_filler)

    def dispatch_ebnf(self, spec: str) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiler.compile_grammar(spec, root_rule_name="root"), self.mask_filler)

    def dispatch_choice(self, spec: str) -> XGrammarGrammar:
        # JSON string literals are valid EBNF literals (checked for quotes, backslashes,
        # control characters and non-ASCII).
        choices = json.loads(spec)
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return XGrammarGrammar(self.compiler.compile_grammar(ebnf), self.mask_filler)

    def dispatch_structural_tag(self, spec: str) -> XGrammarGrammar:
        tag = json.loads(spec)
        if "format" in tag:  # xgrammar's own structural-tag format
            return XGrammarGrammar(self.compiler.compile_structural_tag(spec), self.mask_filler)
        # SGLang's format: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in _structures(tag)]
        return XGrammarGrammar(self.compiler.compile_structural_tag(items, list(tag["triggers"])), self.mask_filler)


def _structures(tag: dict) -> list[dict]:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError('structural_tag needs non-empty "structures" and "triggers" lists')
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
            raise ValueError('each structure needs "begin", "schema" and "end"')
    return structures
