"""A third-party grammar backend for tests, loaded with ``--grammar-backend-plugins
slow_grammar_plugin --grammar-backend slow`` (tests/ on PYTHONPATH): xgrammar, except that
regexes starting with "slow" take 20 s to compile."""
from __future__ import annotations

import threading

from constrained.registry import register_grammar_backend
from constrained.xgrammar_backend import XGrammarGrammarBackend


class SlowBackend(XGrammarGrammarBackend):
    name = "slow"
    never = threading.Event()

    def dispatch_regex(self, spec: str):
        if spec.startswith("slow"):
            self.never.wait(20)
        return super().dispatch_regex(spec)


register_grammar_backend("slow", SlowBackend.from_tokenizer)
