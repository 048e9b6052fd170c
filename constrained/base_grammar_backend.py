"""The grammar-object interface and the compile-and-cache machinery every backend shares.

A backend compiles ``(kind, normalized spec)`` keys on a thread pool. The cache holds
only results the scheduler has *agreed* on (``set_cache`` is called by the grammar
manager after the cross-rank agreement), so on every rank of a TP group the same request
sees the same hit or miss. In-flight compiles are a per-rank optimisation: concurrent
requests for one key share one Future; they never decide a hit.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Union

import torch

from constrained.bitmask_ops import allocate_token_bitmask, apply_token_bitmask_inplace
from constrained.grammar_config import JSON_LAYOUT_KEY, json_layout
from constrained.grammar_errors import clean_error  # noqa: F401  (re-exported)
from constrained.grammar_metrics import GrammarMetrics
from constrained.schema_coverage import StrictSchemaError, split_strict
from constrained.schema_refs import check_no_external_refs

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind, normalized spec): kind in CONSTRAINT_FIELDS


@dataclass
class GrammarStats:
    """Per grammar object, for logs and benchmarks (never crosses a process boundary)."""

    compile_time: float = 0.0  # seconds spent compiling (0 for a cache hit)
    cache_hit: bool = False
    dispatch_type: str = ""  # the backend that compiled it; auto adds why it fell back
    num_timeouts: int = 0  # poll budgets this key exhausted before it compiled
    # json_schema: the keywords the grammar does not enforce ("uniqueItems at #/tags"),
    # schema_coverage.py; empty = exact (every admitted document is valid).
    gaps: tuple[str, ...] = ()


class BaseGrammarObject:
    """One request's matcher. ``copy()`` gives a fresh matcher over the same compiled
    grammar (the cache keeps a pristine object and hands out copies)."""

    # Shared by one backend's objects: ``fill(grammars, vocab_mask, rows)`` computes many
    # rows in one library call on its own threads (no GIL). None: rows are filled one by one.
    mask_filler = None
    # Most tokens ``rollback`` can undo (None: any number). Speculative drafts stay below it.
    max_rollback: Optional[int] = None

    def __init__(self) -> None:
        self.finished = False  # set by the scheduler when the request ends
        self.stats = GrammarStats()

    def accept_token(self, token: int) -> None:
        """Advance by one sampled token; raise ValueError if the grammar rejects it."""
        raise NotImplementedError

    def rollback(self, k: int) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """The grammar accepted a stop token (or can accept nothing more)."""
        raise NotImplementedError

    def maybe_init_reasoning(self, reasoning: bool, budget: Optional[int] = None) -> None:
        """Thinking models (``budget``: the request's thinking_budget): only
        ReasonerGrammarObject cares."""

    def needs_vocab_mask(self) -> bool:
        return not self.finished and not self.is_terminated()

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int,
                            device: Union[str, torch.device]) -> torch.Tensor:
        # Filled on the CPU (the libraries write host memory), then moved.
        return allocate_token_bitmask(batch_size, vocab_size, "cpu")

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        raise NotImplementedError

    def has_error(self) -> bool:
        """The matcher reached a dead end it reports itself (llguidance) after a fill."""
        return False

    def allows_token(self, token: int) -> Optional[bool]:
        """True only where ``token`` may come next, the matcher left as it was; False or
        None (cannot tell without a mask): sampling/check_first.py fills the mask then."""
        return None

    def mask_source(self) -> "BaseGrammarObject":
        """The object whose ``mask_filler`` fills this row (wrappers return the inner one)."""
        return self

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Union[str, torch.device]) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        apply_token_bitmask_inplace(logits, vocab_mask)

    def copy(self) -> "BaseGrammarObject":
        raise NotImplementedError

    def export(self) -> tuple[str, bytes]:
        """(format, data) from which the backend's ``load`` rebuilds this compiled grammar in
        another process (the node's compile pool, ``srt/grammar_pool``); ("rebuild", b"") when
        compiling it again costs less than shipping it. NotImplementedError: this kind of
        object compiles in the rank's own threads."""
        raise NotImplementedError

    def fast_forward(self, max_tokens: int) -> list[int]:
        """Grammar fast-forward: the tokens the grammar forces next (a single continuation,
        e.g. the rest of a JSON key), at most ``max_tokens``, already accepted into this
        matcher; [] when the next token is a real choice. A pure function of the matcher
        state, so every rank of a TP group forces the same tokens."""
        return []


def fresh_copy(value: BaseGrammarObject) -> BaseGrammarObject:
    """A new matcher over ``value``'s grammar, with what its stats say about the grammar."""
    twin = value.copy()
    if twin is not value:
        twin.stats.dispatch_type, twin.stats.gaps = value.stats.dispatch_type, value.stats.gaps
    return twin


class InvalidGrammarObject(BaseGrammarObject):
    """A compile failure, cached like a success so a bad spec is not compiled twice."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def is_terminated(self) -> bool:
        return True

    def copy(self) -> "InvalidGrammarObject":
        return self

    def export(self) -> tuple[str, bytes]:
        return "invalid", self.message.encode()


NO_OUTPUT_MESSAGE = (
    "The {kind} grammar admits no output: no token can start a matching text (for example a "
    "schema that only refers to itself, or constraints that contradict each other).")


def allows_no_token(grammar: BaseGrammarObject, vocab_size: int) -> bool:
    """Does a fresh matcher of ``grammar`` allow no token at all (not even EOS)?"""
    probe = grammar.copy()
    if probe.is_terminated():
        return False
    mask = probe.allocate_vocab_mask(vocab_size, 1, "cpu")
    probe.fill_vocab_mask(mask, 0)
    return not bool(mask.any()) or probe.has_error()


class BaseGrammarBackend:
    """Subclasses implement ``dispatch_<kind>(spec) -> BaseGrammarObject`` (raising on a
    bad spec); everything else -- pool, cache, failures, stats -- lives here."""

    name = "base"
    # Set by create_grammar_backend: each compiled grammar is then probed once, and one
    # that allows no token at its start (it admits no output at all) is a compile failure.
    vocab_size: Optional[int] = None
    # Reads a json_schema spec's per-request whitespace (grammar_config.JSON_LAYOUT_KEY);
    # a backend that does not is refused such a spec instead of ignoring it.
    supports_json_layout = False

    def __init__(self, num_threads: int = 2, cache_size: int = 1024) -> None:
        self.executor = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarKey, BaseGrammarObject] = OrderedDict()
        self._inflight: dict[GrammarKey, Future] = {}
        self.metrics = GrammarMetrics()  # cumulative counters for --enable-metrics
        # The node's compile pool (srt/grammar_pool): misses compile there, not on our threads.
        self.compile_pool = None

    # ---- compiling --------------------------------------------------------------------
    def dispatch(self, key: GrammarKey) -> BaseGrammarObject:
        kind, spec = key
        if kind in ("json_schema", "structural_tag"):
            check_no_external_refs(spec, kind)  # never fetch: see schema_refs.py
        if kind == "json_schema" and not self.supports_json_layout and json_layout(spec) is not None:
            raise ValueError(f"the {self.name} grammar backend does not support per-request JSON "
                             f"whitespace options ({JSON_LAYOUT_KEY})")
        method = getattr(self, f"dispatch_{kind}", None)
        if method is None:
            raise ValueError(f"the {self.name} grammar backend does not support {kind} constraints")
        if kind == "json_schema":
            return self.compile_json_schema(*split_strict(spec))
        return method(spec)

    def compile_json_schema(self, spec: str, strict: bool) -> BaseGrammarObject:
        """A json_schema grammar with ``stats.gaps`` set (schema_coverage.py). ``strict``: exact
        or a ValueError naming the gaps. Backends that know what they enforce override this; a
        plugin's grammar counts as approximate (its documents are validated)."""
        if strict:
            raise StrictSchemaError([], f"the {self.name} grammar backend does not say which keywords "
                                    "it enforces")
        value = self.dispatch_json_schema(spec)
        value.stats.gaps = (f"(the {self.name} backend does not say which keywords it enforces)",)
        return value

    def init_value(self, key: GrammarKey) -> BaseGrammarObject:
        """Compile ``key``; never raises: a failure becomes an InvalidGrammarObject."""
        start = time.perf_counter()
        try:
            value = self.dispatch(key)
            if self.vocab_size is not None and allows_no_token(value, self.vocab_size):
                value = InvalidGrammarObject(NO_OUTPUT_MESSAGE.format(kind=key[0]))
        except Exception as e:  # the library's reason goes to the user
            value = InvalidGrammarObject(f"Failed to compile {key[0]} grammar: {clean_error(e)}")
        value.stats.compile_time = time.perf_counter() - start
        value.stats.dispatch_type = value.stats.dispatch_type or self.name
        self.metrics.observe_compile(value.stats.dispatch_type, key[0], value.stats.compile_time,
                                     isinstance(value, InvalidGrammarObject))
        return value

    def load(self, fmt: str, data: bytes) -> BaseGrammarObject:
        """Rebuild a grammar compiled in another process from ``BaseGrammarObject.export``."""
        raise NotImplementedError

    def load_exported(self, fmt: str, data: bytes) -> BaseGrammarObject:
        return InvalidGrammarObject(data.decode()) if fmt == "invalid" else self.load(fmt, data)

    def can_use_compile_pool(self) -> bool:
        """Built-in backends export and load their grammars; a plugin that does not
        compiles on the rank's own threads, as before."""
        return type(self).load is not BaseGrammarBackend.load

    def attach_compile_pool(self, client) -> None:
        """Compile every miss in the node's pool (``srt.grammar_pool.client``)."""
        self.compile_pool = client

    def get_cached_or_future_value(self, key: GrammarKey) -> tuple[Union[BaseGrammarObject, Future], bool]:
        """(copy, True) on a hit; (Future of the pristine object, False) on a miss."""
        value = self._cache.get(key)
        if value is not None:
            self._cache.move_to_end(key)
            copy = fresh_copy(value)
            copy.stats.cache_hit = True
            self.metrics.count("cache_hits")
            return copy, True
        self.metrics.count("cache_misses")
        future = self._inflight.get(key)
        if future is None or future.cancelled():
            if self.compile_pool is not None:
                future = self.compile_pool.submit(key, self)
            else:
                future = self.executor.submit(self.init_value, key)
            self._inflight[key] = future
        return future, False

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        """Called only at points every rank reaches identically (after agreement)."""
        self._inflight.pop(key, None)
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def release(self, key: GrammarKey, still_waiting: bool) -> None:
        """No request waits for ``key`` any more (aborted or timed out): cancel its compile
        if it has not started. ``still_waiting``: another queued request shares it."""
        future = self._inflight.get(key)
        if future is None or still_waiting:
            return
        future.cancel()  # a started compile on our threads runs on; the pool's is killed
        self._inflight.pop(key, None)
        if self.compile_pool is not None:
            self.compile_pool.release(key)

    def cache_info(self) -> dict:
        return {"cached": len(self._cache), "in_flight": len(self._inflight)}

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
