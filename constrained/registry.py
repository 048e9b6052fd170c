"""Grammar backends by name: the built-ins plus any registered with
``register_grammar_backend(name, factory)``. A factory is called as
``factory(tokenizer, config: GrammarBackendConfig) -> BaseGrammarBackend`` on every rank.

Scheduler ranks are separate processes: a third-party backend registers itself in a module
named by ``--grammar-backend-plugins``, which every rank imports before looking it up."""
from __future__ import annotations

import importlib
from typing import Callable, Optional

from constrained.base_grammar_backend import BaseGrammarBackend
from constrained.grammar_config import GrammarBackendConfig
from constrained.reasoner_grammar_backend import ReasonerGrammarBackend, think_end_token_id

GrammarBackendFactory = Callable[..., BaseGrammarBackend]


def _xgrammar(tokenizer, config):
    from constrained.xgrammar_backend import XGrammarGrammarBackend
    return XGrammarGrammarBackend.from_tokenizer(tokenizer, config)


def _llguidance(tokenizer, config):
    from constrained.llguidance_backend import GuidanceBackend
    return GuidanceBackend.from_tokenizer(tokenizer, config)


def _outlines(tokenizer, config):
    from constrained.outlines_backend import OutlinesGrammarBackend
    return OutlinesGrammarBackend.from_tokenizer(tokenizer, config)


def _auto(tokenizer, config):
    from constrained.auto_backend import AutoGrammarBackend
    return AutoGrammarBackend.from_tokenizer(tokenizer, config)


# Name -> factory. Mutated only by register_grammar_backend, at import time of plugins.
GRAMMAR_BACKEND_REGISTRY: dict[str, GrammarBackendFactory] = {
    "xgrammar": _xgrammar, "llguidance": _llguidance, "auto": _auto, "outlines": _outlines,
}


def register_grammar_backend(name: str, factory: GrammarBackendFactory) -> None:
    if name == "none":
        raise ValueError('"none" is reserved: it disables constrained generation')
    GRAMMAR_BACKEND_REGISTRY[name] = factory


def import_plugins(modules: Optional[str]) -> None:
    for module in filter(None, (m.strip() for m in (modules or "").split(","))):
        importlib.import_module(module)


def create_grammar_backend(server_args, tokenizer, vocab_size: int,
                           eos_token_ids: tuple[int, ...]) -> Optional[BaseGrammarBackend]:
    """The rank's backend for ``--grammar-backend`` (None for "none")."""
    import_plugins(server_args.grammar_backend_plugins)
    name = server_args.grammar_backend
    if name == "none":
        return None
    factory = GRAMMAR_BACKEND_REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"Unknown --grammar-backend {name!r}; available: none, "
                         f"{', '.join(sorted(GRAMMAR_BACKEND_REGISTRY))}")
    config = GrammarBackendConfig.from_server_args(server_args, vocab_size, eos_token_ids)
    backend = factory(tokenizer, config)
    if server_args.reasoning_parser:
        think_end = think_end_token_id(tokenizer, server_args.reasoning_parser)
        backend = ReasonerGrammarBackend(backend, think_end, config.num_threads, config.cache_size)
    backend.vocab_size = vocab_size  # enables the no-output check after each compile
    return backend
