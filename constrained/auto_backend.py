"""``--grammar-backend auto``: xgrammar first, llguidance per request when xgrammar rejects
the spec or the spec uses a feature xgrammar is known to approximate silently.

xgrammar (0.2.x) compiles oneOf as anyOf, only partly enforces allOf, ignores length
bounds next to a pattern, drops not/if/uniqueItems/contains, and drops multipleOf on numbers
and on integers in ranges too large to enumerate (every integer, once bounded by default);
llguidance enforces those or rejects the schema. A schema llguidance rejects gets xgrammar's
approximation rather than a 400 (what --grammar-backend xgrammar serves). Why a request went
where it did is in its GrammarStats,
and each fallback is counted by reason and outcome in ``self.metrics`` (--enable-metrics)."""
from __future__ import annotations

import json
from typing import Any, Optional

from constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, clean_error
from constrained.grammar_config import GrammarBackendConfig, json_layout
from constrained.grammar_metrics import fallback_label
from constrained.llguidance_backend import GuidanceBackend
from constrained.xgrammar_backend import XGrammarGrammarBackend

_XGRAMMAR_APPROXIMATES = ("oneOf", "not", "if", "uniqueItems", "contains", "dependentRequired",
                          "dependentSchemas", "patternProperties", "propertyNames", "multipleOf")


def xgrammar_known_issue(spec: str) -> Optional[str]:
    """The first JSON-schema feature xgrammar would approximate, or None."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if found:
            return
        if isinstance(node, dict):
            for key in _XGRAMMAR_APPROXIMATES:
                if key in node:
                    found.append(key)
                    return
            if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
                found.append("allOf")
                return
            if "pattern" in node and ("minLength" in node or "maxLength" in node):
                found.append("pattern with minLength/maxLength")
                return
            for key, value in node.items():
                if key not in ("enum", "const", "default", "examples"):  # data, not schema
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(spec))
    return found[0] if found else None


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
        kind, spec = key
        reason, to_guidance = None, False  # to_guidance: only llguidance can serve it
        if kind == "json_schema":
            if self.json_to_guidance:
                reason, to_guidance = "--constrained-json-whitespace-pattern", True
            elif "whitespace_pattern" in (json_layout(spec) or {}):
                reason, to_guidance = "a per-request whitespace_pattern", True
            else:
                reason = xgrammar_known_issue(spec)
            reason = reason and f"uses {reason}"
        if reason is None:
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
            reason = f"{reason}; llguidance: {clean_error(e)}"
            if reason.startswith("xgrammar rejected it") or to_guidance:
                self.metrics.count_fallback(label, "failed")
                raise ValueError(reason) from None
            return self._approximate(key, reason, label)
        value.stats.dispatch_type = f"llguidance (fallback: {reason})"
        self.metrics.count_fallback(label, "llguidance")
        return value

    def _approximate(self, key: tuple[str, str], reason: str, label: str) -> BaseGrammarObject:
        """llguidance refused a spec xgrammar only approximates: serve xgrammar's reading."""
        try:
            value = self.xgrammar.dispatch(key)
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
