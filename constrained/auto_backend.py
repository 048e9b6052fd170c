"""``--grammar-backend auto``: per json_schema request, the exact grammar if a library has
one, else the closest approximation (docs/constrained.md "Structured outputs"); other kinds go to
xgrammar, and to llguidance when xgrammar rejects the spec.

json_schema, in order (schema_coverage.py decides what is exact):
1. llguidance in its default mode, which refuses any keyword it does not enforce: exact
   whenever it compiles, and it compiles in about a millisecond where xgrammar can take
   seconds (the real-world corpus: under full load xgrammar compiles timed out, docs/constrained.md);
2. xgrammar, when it enforces every keyword (a few schemas llguidance refuses);
3. not strict: whichever approximation drops fewer keywords -- llguidance lenient (oneOf as
   anyOf, unsupported keywords dropped) or xgrammar; llguidance on a tie (it enforces the
   rest exactly). The frontend validates those documents.
A strict schema that neither serves exactly is refused with the gaps of the closer one.
Why a request went where it did is in its GrammarStats, and each fallback is counted by
reason and outcome in ``self.metrics`` (--enable-metrics)."""
from __future__ import annotations

import json

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, clean_error
from constrained.grammar_config import GrammarBackendConfig, json_layout
from constrained.grammar_metrics import fallback_label
from constrained.llguidance_backend import GuidanceBackend
from constrained.schema_coverage import StrictSchemaError, xgrammar_gaps
from constrained.tag_parts import tag_parts
from constrained.tag_plan import plan_tag
from constrained.xgrammar_backend import XGrammarGrammarBackend


class AutoGrammarBackend(BaseGrammarBackend):
    name = "auto"
    supports_json_layout = True  # a per-request whitespace_pattern goes to llguidance

    def __init__(self, xgrammar_backend: XGrammarGrammarBackend, guidance_backend: GuidanceBackend,
                 config: GrammarBackendConfig) -> None:
        super().__init__(config.num_threads, config.cache_size)
        # The inner backends only compile (their dispatch_* run on our pool).
        self.xgrammar, self.guidance = xgrammar_backend, guidance_backend
        self.json_to_guidance = config.json.whitespace_pattern is not None

    @classmethod
    def from_tokenizer(cls, tokenizer, config: GrammarBackendConfig) -> "AutoGrammarBackend":
        import dataclasses

        xgr_config = dataclasses.replace(config, json=dataclasses.replace(config.json, whitespace_pattern=None))
        return cls(XGrammarGrammarBackend.from_tokenizer(tokenizer, xgr_config),
                   GuidanceBackend.from_tokenizer(tokenizer, config), config)

    def dispatch(self, key: tuple[str, str]) -> BaseGrammarObject:
        if key[0] in ("json_schema", "structural_tag"):
            return super().dispatch(key)  # its checks, then compile_json_schema / the tag's plan
        try:
            value = self.xgrammar.dispatch(key)
            value.stats.dispatch_type = "xgrammar"
            return value
        except Exception as e:
            reason = f"xgrammar rejected it: {clean_error(e)}"
        label = fallback_label(reason)
        try:
            value = self.guidance.dispatch(key)
        except Exception as e:
            self.metrics.count_fallback(label, "failed")
            raise ValueError(f"{reason}; llguidance: {clean_error(e)}") from None
        value.stats.dispatch_type = f"llguidance (fallback: {reason})"
        self.metrics.count_fallback(label, "llguidance")
        return value

    def dispatch_json_schema(self, spec: str) -> BaseGrammarObject:
        return self.compile_json_schema(spec, False)

    def dispatch_structural_tag(self, spec: str) -> BaseGrammarObject:
        """tag_plan.py picks the library: exact where one is, else the closer approximation
        (parts that must be exact exact); the other library only when the chosen one fails."""
        tag = json.loads(spec)
        plan = plan_tag(tag_parts(tag), "auto", self.guidance.json_options)
        first, second = ((self.xgrammar, self.guidance) if plan.library == "xgrammar"
                         else (self.guidance, self.xgrammar))
        try:
            value = first.compile_structural_tag(tag, plan)
            value.stats.dispatch_type = first.name
            return value
        except Exception as e:
            reason = f"{first.name} rejected it: {clean_error(e)}"
        label = fallback_label(reason)
        try:
            second_plan = plan_tag(tag_parts(tag), second.name, self.guidance.json_options)
            value = second.compile_structural_tag(tag, second_plan)
        except Exception as e:
            self.metrics.count_fallback(label, "failed")
            raise ValueError(f"{reason}; {second.name}: {clean_error(e)}") from None
        value.stats.dispatch_type = f"{second.name} (fallback: {reason})"
        self.metrics.count_fallback(label, second.name)
        return value

    def compile_json_schema(self, spec: str, strict: bool) -> BaseGrammarObject:
        try:  # 1. llguidance's default mode: exact whenever it compiles, in about a millisecond
            value = self.guidance.dispatch_json_schema(spec)
            value.stats.dispatch_type = "llguidance"
            return value
        except Exception as e:
            reason = f"llguidance refused it: {clean_error(e)}"
        label = fallback_label(reason)
        only_guidance = None  # whitespace patterns: only llguidance has them
        if self.json_to_guidance:
            only_guidance = "--constrained-json-whitespace-pattern"
        elif "whitespace_pattern" in (json_layout(spec) or {}):
            only_guidance = "a per-request whitespace_pattern"
        x_gaps, x_error = xgrammar_gaps(json.loads(spec)), only_guidance and f"it has no {only_guidance}"
        if not x_error and not x_gaps:  # 2. xgrammar, where it enforces every keyword
            try:
                value = self.xgrammar.compile_json_schema(spec, strict)
                value.stats.dispatch_type = f"xgrammar (fallback: {reason})"
                self.metrics.count_fallback(label, "xgrammar")
                return value
            except Exception as e:
                x_error = clean_error(e)
        try:  # 3. the approximation dropping fewer keywords; llguidance's lenient mode on a tie
            value = self.guidance.compile_json_schema(spec, strict)
        except StrictSchemaError as e:  # strict, and neither library is exact: the closer one's gaps
            self.metrics.count_fallback(label, "failed")
            gaps = e.gaps if x_error or len(e.gaps) <= len(x_gaps) else x_gaps
            raise StrictSchemaError(gaps, "no grammar library enforces") from None
        except Exception as e:
            if x_error:
                self.metrics.count_fallback(label, "failed")
                raise ValueError(f"llguidance: {clean_error(e)}; xgrammar: {x_error}") from None
            return self._xgrammar_approximation(spec, reason, label, x_gaps, strict)
        if value.stats.gaps and not x_error and len(x_gaps) < len(value.stats.gaps):
            return self._xgrammar_approximation(spec, reason, label, x_gaps, strict)
        kind = "approximate" if value.stats.gaps else "lenient, exact"
        value.stats.dispatch_type = f"llguidance ({kind}: {reason})"
        self.metrics.count_fallback(label, "llguidance_approximation" if value.stats.gaps else "llguidance")
        return value

    def _xgrammar_approximation(self, spec: str, reason: str, label: str, gaps, strict: bool) -> BaseGrammarObject:
        """llguidance's lenient mode refused the schema, or drops more of it: xgrammar's reading."""
        if strict:
            self.metrics.count_fallback(label, "failed")
            raise StrictSchemaError(gaps, "no grammar library enforces")
        try:
            value = self.xgrammar.compile_json_schema(spec, False)
        except Exception as e:
            self.metrics.count_fallback(label, "failed")
            raise ValueError(f"{reason}; xgrammar: {clean_error(e)}") from None
        value.stats.dispatch_type = f"xgrammar (approximate: {reason})"
        self.metrics.count_fallback(label, "xgrammar_approximation")
        return value

    def load(self, fmt: str, data: bytes) -> BaseGrammarObject:
        return (self.guidance if fmt == "llguidance" else self.xgrammar).load(fmt, data)

    def shutdown(self) -> None:
        for backend in (self, self.xgrammar, self.guidance):
            BaseGrammarBackend.shutdown(backend)
